"""DeploymentConfig (runtime/deploy/config.py) refuses bad settings naming the field."""

from __future__ import annotations

import pytest

from runtime.deploy.config import DeploymentConfig


@pytest.mark.parametrize(
    "field",
    ["num_pages", "kv_cache_memory_bytes", "gpu_memory_utilization", "frame_timeout_multiple",
     "frame_timeout_margin_s"],
)  # fmt: skip
def test_deployment_config_refuses_bad_sizing_and_timeouts_naming_the_field(field):

    for bad in (0, -1, 1.5 if field == "gpu_memory_utilization" else float("inf"), True):
        if bad is True and field not in ("num_pages", "kv_cache_memory_bytes"):
            continue
        with pytest.raises(ValueError, match=field):
            DeploymentConfig(**{field: bad})
