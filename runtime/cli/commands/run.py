"""``flare run [MODEL_DIR]`` (also ``flare serve MODEL_DIR``, as vLLM users type it).

It serves a model directory (default: the embedded model, created on first use,
no download) over an OpenAI-compatible HTTP API: the frontend (this process),
the coordinator and N rank processes on this machine.  With ``--prompt`` it
instead generates one completion in-process, prints it and the run's figures,
and exits (commands/prompt.py).

Every flag and model-directory problem fails before any process starts, in one
stderr line naming the flag or file (:func:`checked_run`).  The flags come in
families, one module each under flags/; ``--config FILE`` is config_file.py's.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING

from runtime.cli.commands.image_prompt import image_prompt, read_images
from runtime.cli.commands.prompt import generate_once
from runtime.cli.config_file import apply_config_file
from runtime.cli.flags.debugging import (
    add_debug_flags,
    add_trace_flags,
    check_trace_path,
    debug_config,
)
from runtime.cli.flags.deployment import add_deployment_flags, add_external_flags, external_ranks
from runtime.cli.flags.families import add_flag_groups
from runtime.cli.flags.generation import (
    add_generation_flags,
    check_prompt,
    load_tokenizer,
    sampling,
)
from runtime.cli.flags.identity import add_identity_flags, identity_config
from runtime.cli.flags.liveness import add_liveness_flags, liveness_config
from runtime.cli.flags.memory import (
    add_kv_flags,
    add_prefix_cache_flags,
    kv_pool,
    prefix_cache_config,
)
from runtime.cli.flags.model import add_model_flags, model_dir
from runtime.cli.flags.scheduling import add_scheduling_flags, policy
from runtime.cli.flags.security import (
    add_api_key_flag,
    add_transport_flags,
    api_keys,
    transport_config,
    without_secrets,
)
from runtime.cli.flags.serving import (
    add_reliability_flags,
    add_server_flags,
    check_chat_template,
    image_limits,
    serving_options,
)
from runtime.cli.flags.speculation import add_speculation_flags, speculation_config
from runtime.cli.flags.vision import (
    add_image_flag,
    add_vision_flags,
    check_vision,
    flag_message,
    vision_config,
)
from runtime.cli.parsing import HelpFormatter, explicit, run_parser
from runtime.coordinator.config import PolicyConfig
from runtime.deploy.config import DeploymentConfig
from runtime.deploy.devices import device_problem
from runtime.deploy.external import ExternalRanks
from runtime.ranks.memory import MIN_CONTEXT, KVCacheSizeError

if TYPE_CHECKING:
    from runtime.ranks.model.config import ModelConfig

log = logging.getLogger("runtime.cli")

# Flags of features that later issues build: refused rather than ignored.
NOT_YET: dict[str, str] = {}

RUN_USAGE = "%(prog)s [MODEL_DIR] [--prompt TEXT] [OPTIONS]"
# Set by the frontend for its coordinator process (python -m runtime.coordinator).
COORDINATOR_ONLY = ("--api-requests", "--api-outputs", "--api-debug")


def add_run_command(sub) -> argparse.ArgumentParser:
    """``flare run`` (and its alias ``serve``) under ``sub``."""
    run = sub.add_parser(
        "run",
        aliases=["serve"],
        help="serve a model over HTTP (or generate once with --prompt); serve is an alias",
        usage=RUN_USAGE,
        description="Serve MODEL_DIR over an OpenAI-compatible HTTP API, or generate one "
        "completion with --prompt. `flare serve` is the same command. The flags come in "
        "families: serving, generation, model, memory, scheduling, speculation, deployment, "
        "security, debugging.",
        formatter_class=HelpFormatter,
    )
    add_run_flags(run)
    return run


def add_run_flags(run: argparse.ArgumentParser) -> None:
    """Every flag of ``flare run``, each in its family (flags/families.py)."""
    add_flag_groups(run)
    run._optionals.title = "general"
    run.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file with [scheduler] and [run] tables; flags given on the command line "
        "win (default: none)",
    )
    add_server_flags(run)
    add_generation_flags(run)
    add_image_flag(run)
    add_model_flags(run)
    add_kv_flags(run)
    add_prefix_cache_flags(run)
    add_scheduling_flags(run)
    add_vision_flags(run)
    add_speculation_flags(run)
    add_deployment_flags(run)
    add_api_key_flag(run)
    add_trace_flags(run)
    add_debug_flags(run)
    add_liveness_flags(run)
    add_identity_flags(run)
    add_external_flags(run)
    add_reliability_flags(run)
    add_transport_flags(run)
    for flag in COORDINATOR_ONLY:
        run.add_argument(flag, help=argparse.SUPPRESS)


def _checked_flags(
    args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]
) -> tuple[PolicyConfig, ExternalRanks | None]:
    """``--config`` applied, then the flags that need no model checked: the
    scheduling policy and the external ranks (None: local)."""
    data = apply_config_file(args, parser, argv)
    for dest, feature in NOT_YET.items():
        if getattr(args, dest) is not None:
            flag = "--" + dest.replace("_", "-")
            parser.error(f"{flag}: {feature} are not available in this build yet")
    scheduling = policy(args, parser, data)
    external = external_ranks(args, parser, explicit(parser, argv))
    if external is not None:
        args.tensor_parallel_size = external.world_size
    if not 0 < args.startup_timeout < float("inf"):
        parser.error("--startup-timeout must be a finite number of seconds > 0")
    args.chat_template = check_chat_template(args.chat_template, parser)
    args.image_files = read_images(args, parser, image_limits(args))
    args.api_key = api_keys(args, parser)
    try:
        args.trace = check_trace_path(args.trace)
    except ValueError as exc:
        parser.error(str(exc))
    return scheduling, external


def _checked_model(
    args: argparse.Namespace, parser: argparse.ArgumentParser, external: ExternalRanks | None
) -> tuple[str, str, ModelConfig]:
    """The model directory, how the command line named it, and its config,
    checked against the tensor-parallel size, the devices and ``--max-model-len``."""
    directory, named = model_dir(args, parser)
    if not os.path.exists(directory):
        parser.error(f"{named}: no such directory")
    if not os.path.isdir(directory):
        parser.error(f"{named}: not a directory")
    from runtime.ranks.model.checkpoint import check_model_dir
    from runtime.ranks.model.errors import LoadError, ModelConfigError

    try:
        model = check_model_dir(directory)
    except (ModelConfigError, LoadError) as exc:
        parser.error(f"{named}: {exc}")
    tp = args.tensor_parallel_size
    try:
        model.check_tensor_parallel(tp)
    except ModelConfigError as exc:
        allowed = ", ".join(map(str, model.tensor_parallel_sizes()))
        parser.error(f"--tensor-parallel-size {tp}: {exc} ({named}); allowed: {allowed}")
    if external is None:  # external ranks run on their own machines' devices
        problem = device_problem(args.device, tp)
        if problem is not None:
            parser.error(problem)
    limit = model.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > limit:
        parser.error(
            f"--max-model-len {args.max_model_len} exceeds the model's {limit} "
            f"(max_position_embeddings of {named}); allowed: {MIN_CONTEXT}..{limit}"
        )
    if (args.max_model_len or limit) < MIN_CONTEXT:
        parser.error(
            f"{named}: max_position_embeddings {limit} is below {MIN_CONTEXT}, the shortest "
            "context flare serves"
        )
    return directory, named, model


def checked_run(
    args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str] | None = None
) -> tuple[DeploymentConfig, ModelConfig]:
    """The deployment ``flare run`` asks for and its model's config.

    Every flag and model-directory problem fails here, before any process
    starts, in one line naming the flag or file (``parser.error``: exit 2).
    The model check reads ``config.json`` and looks for the tokenizer and
    weight files; it loads no weight.
    """
    parser = run_parser(parser)  # errors read "flare run: error: ..."
    argv = argv or []
    scheduling, external = _checked_flags(args, parser, argv)
    directory, named, model = _checked_model(args, parser, external)
    try:
        config = DeploymentConfig(
            model=directory,
            tensor_parallel_size=args.tensor_parallel_size,
            max_concurrency=args.max_concurrency,
            max_prefill_tokens=args.max_prefill_tokens,
            page_size=args.page_size,
            num_pages=args.num_pages,
            kv_cache_memory_bytes=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            device=args.device,
            dtype=args.dtype,
            policy=scheduling,
            cuda_graphs=not args.enforce_eager,
            mixed_prefill=bool(args.mixed_prefill),
            packed_prefill=not args.no_packed_prefill,
            scored_prefill=not args.no_scored_prefill,
            startup_timeout_s=args.startup_timeout,
            frame_timeout_multiple=args.frame_timeout_multiple,
            frame_timeout_margin_s=args.frame_timeout_margin,
            speculation=speculation_config(args, parser, model),
            external=external,
            **prefix_cache_config(args),
            **debug_config(args),
            **transport_config(args, parser),
            **liveness_config(args, parser),
            **identity_config(args),
            **vision_config(args),
        )
    except ValueError as exc:
        parser.error(flag_message(str(exc)))
        raise  # unreachable
    check_vision(parser, config, model, named, bool(args.image_files))
    pool = kv_pool(config, model)
    try:
        if pool is not None:  # else the ranks check theirs at start-up
            pool.check(args.max_model_len or model.max_position_embeddings, args.max_model_len)
    except KVCacheSizeError as exc:
        parser.error(str(exc))
    return config, model


def deployment_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str] | None = None
) -> DeploymentConfig:
    """The deployment ``flare run`` asks for; fails fast naming the bad flag."""
    return checked_run(args, parser, argv)[0]


def configure_logging(level: str, process: str) -> None:
    """This process's log lines, ``[process] LEVEL message`` at ``--log-level``
    (warning unless asked), a flood of one message a burst and a count; a no-op
    where logging is set up already (a test)."""
    from runtime.logs import basic_config

    basic_config(level.upper(), f"[{process}] %(levelname)s %(message)s")


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """``flare run`` / ``flare serve``: every check first, then the processes."""
    parser = run_parser(parser)
    # --prompt: the engine runs here; serving: this process is the frontend.
    configure_logging(args.log_level, "flare" if args.prompt is not None else "frontend")
    config, model = checked_run(args, parser, argv)
    params = sampling(args, parser)
    tokenizer = load_tokenizer(config.model, parser)
    context = min(model.max_position_embeddings, config.max_model_len or 1 << 62)
    pool = kv_pool(config, model)
    images = ()
    if args.image_files:  # a chat request, prepared as the HTTP server's chat route does
        ids, images = image_prompt(args, parser, config, model, pool, context)
    elif args.prompt is not None:
        ids = tokenizer.encode(args.prompt).ids
    if args.prompt is not None:
        check_prompt(args, parser, config, pool, context, ids)
    shortfall = pool.shortfall(context) if pool is not None else None
    if shortfall is not None:  # every check passed: a warning, then the start
        log.warning(shortfall)
    if args.prompt is not None:
        return generate_once(args, config, params, tokenizer, ids, images)
    from runtime.frontend.serve import ServeOptions, serve

    return serve(
        ServeOptions(
            model_dir=config.model,
            host=args.host,
            port=args.port,
            api_key=args.api_key or None,
            # External ranks load their shards before they connect: the
            # coordinator waits for them first.
            startup_timeout_s=args.startup_timeout
            + (config.external.handshake_timeout_s if config.external else 0.0),
            coordinator_args=without_secrets(argv),
            chat_template=args.chat_template,
            max_choices_per_request=args.max_choices_per_request,
            debug_endpoints=args.debug_endpoints,
            log_level=args.log_level,
            **serving_options(args, parser),
        )
    )
