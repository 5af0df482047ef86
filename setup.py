"""Packaging for the flare tensor-parallel serving runtime."""

from setuptools import find_packages, setup

setup(
    name="flare-runtime",
    version="0.1.0",
    description=(
        "Tensor-parallel LLM serving runtime whose coordinator chooses prepared "
        "programs by expected useful value per execution time."
    ),
    python_requires=">=3.10",
    packages=find_packages(include=["runtime", "runtime.*", "kernels", "kernels.*"]),
    # The embedded default model and its draft (scripts/train_default.py), and the
    # default vision model (scripts/train_vision_default.py).
    package_data={"runtime.ranks.model": ["weights/*", "weights/vision/*"]},
    include_package_data=True,
    install_requires=[
        # A range, not a pin: GPU users get their CUDA build. CI installs the
        # CPU build (torch==2.13.0) first, which satisfies this range.
        "torch>=2.4",
        "pyzmq>=25",
        "msgpack>=1.0",
        "psutil>=5.9",
        # The rank's host path: slot-table checks and packing as column operations.
        "numpy>=1.24",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "tqdm>=4.60",
        "tomli>=2.0; python_version < '3.11'",
        # Triton ships for Linux x86-64/aarch64 only; the CPU path never imports
        # it (its kernels' torch references are kernels/reference/).
        "triton>=3.0; platform_system == 'Linux'",
        # The HTTP frontend and the load generator.
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "prometheus_client>=0.20",
        "jinja2>=3.1",
        "httpx>=0.27",
        # Chat images: decoded and preprocessed in the frontend's preprocessing workers.
        "pillow>=10",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",
            "ruff==0.17.6",
            "mypy==2.4.1",
            # Below 5.25: from 5.25 transformers requires Hugging Face's `kernels`
            # distribution, whose import name is this package's `kernels` (the
            # layout the spec asks for), and imports it at `import transformers`
            # (docs/prerequisites.md, "The `kernels` name").
            "transformers>=4.45,<5.25",
            "openai>=1.40",
            "hypothesis>=6.100",
            # tests/frontend/test_reliability.py makes its own TLS certificates.
            "cryptography>=41",
        ],
    },
    entry_points={"console_scripts": ["flare=runtime.cli:main"]},
)
