"""What the routes share: one :class:`Frontend` per app."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.frontend.chat import ChatTemplate
from runtime.frontend.client import CoordinatorClient
from runtime.frontend.debug import DebugLink
from runtime.frontend.defaults import GenerationDefaults
from runtime.frontend.metrics import ServingMetrics
from runtime.frontend.preprocess.image_processor import ImageProcessorConfig
from runtime.frontend.preprocess.pool import PreprocessPool
from runtime.frontend.protocol.requests import ServingLimits
from runtime.frontend.server.admission import Gate
from runtime.frontend.tokenizer import ModelTokenizer


@dataclass
class Frontend:
    """What the routes share."""

    client: CoordinatorClient
    tokenizer: ModelTokenizer
    template: ChatTemplate
    limits: ServingLimits
    metrics: ServingMetrics
    # --api-key: one key, or several (a sequence, or a comma-separated string), each a
    # tenant with its own prefix-cache salt; None: no key needed.
    api_key: str | Sequence[str] | None = None
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    created: int = field(default_factory=lambda: int(time.time()))
    debug: DebugLink | None = None  # --debug-endpoints: the /debug/* routes' link
    gate: Gate | None = None  # liveness, drain and overload (None: admit everything)
    # --preprocess-workers: where large bodies are prepared (None: in this process)
    preprocess: PreprocessPool | None = None
    # The model's preprocessor_config.json when it takes images (limits.accepts_images);
    # None for a text-only model.
    image_processor: ImageProcessorConfig | None = None
