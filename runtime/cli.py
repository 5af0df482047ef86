"""The ``flare`` command line.

``flare run [MODEL_DIR]`` (also ``flare serve MODEL_DIR``, as vLLM users type
it) serves a model directory (default: the embedded model, created on first
use, no download) over an OpenAI-compatible HTTP API: the frontend (this
process), the coordinator and N rank processes on this machine.  With
``--prompt`` it instead generates one completion in-process, prints it and the
run's figures, and exits.  ``flare bench`` drives an OpenAI-compatible endpoint
with a load generator (``runtime.loadgen``).  ``flare trace summary|timeline
FILE`` reads a trace written by ``flare run --trace FILE`` (``runtime.trace``).

Every flag and model-directory problem fails before any process starts, in one
stderr line naming the flag or file (:func:`checked_run`).

``--config FILE`` reads a TOML file: ``[scheduler]`` (a policy, as in
``configs/``) and ``[run]`` (any ``flare run`` flag by a long name, aliases
included, e.g. ``max-num-seqs = 16``); flags given on the command line win.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
import time
from typing import TYPE_CHECKING, NoReturn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from runtime.catalog import MAX_BATCH_CAPACITY, PROMPT_ALIGNMENT, describe_counts
from runtime.cli_debug import (
    add_debug_flags,
    add_ranks_command,
    add_replay_command,
    cmd_ranks,
    cmd_replay,
    debug_config,
)
from runtime.cli_deploy import add_deploy_flags, external_ranks
from runtime.cli_groups import add_flag_groups, flag_group
from runtime.cli_identity import add_identity_flags, identity_config
from runtime.cli_keys import add_keys_command, add_transport_flags, cmd_keys, transport_config
from runtime.cli_liveness import add_liveness_flags, liveness_config
from runtime.cli_memory import add_kv_flags, add_prefix_cache_flags, kv_pool, prefix_cache_config
from runtime.cli_serving import add_serving_flags, serving_options
from runtime.cli_speculation import add_speculation_flags, speculation_config
from runtime.coordinator.config import PRESETS, ConfigError, PolicyConfig
from runtime.devices import DEVICE_CHOICES, device_problem, parse_device
from runtime.local import DTYPES, DeploymentConfig, LocalDeployment
from runtime.ranks.capacity import DEFAULT_MAX_CONCURRENCY
from runtime.ranks.memory import KVCacheSizeError, KVPool
from runtime.trace.cli import (
    add_run_flags,
    add_trace_command,
    check_trace_path,
    cmd_trace,
    trace_options,
)
from runtime.transport.fields import ProtocolError
from runtime.transport.sampling import SamplingParams

if TYPE_CHECKING:
    from runtime.ranks.model.config import ModelConfig

log = logging.getLogger("runtime.cli")

# Flags of features that later issues build: refused rather than ignored.
NOT_YET: dict[str, str] = {}

MIN_CONTEXT = PROMPT_ALIGNMENT  # the shortest context the ranks serve (one prefill bucket)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error on ONE stderr line (no usage block) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help states it already
    (or there is none to state)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default" in help_text.lower() or action.default in (None, argparse.SUPPRESS):
            return help_text
        return super()._get_help_string(action) or help_text


def _int_in(low: int, high: int | None = None, why: str = ""):
    """An integer flag in [low, high]; the error names the flag and the bound."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}{why}, got {value}")
        return value

    return parse


def _positive(text: str) -> int:
    return _int_in(1)(text)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must lie in 1..65535, got {value}")
    return value


def _prefill_tokens(text: str) -> int:
    value = _positive(text)
    if value % PROMPT_ALIGNMENT:
        raise argparse.ArgumentTypeError(f"must be a multiple of {PROMPT_ALIGNMENT}, got {value}")
    return value


def _model_len(text: str) -> int:
    return _int_in(MIN_CONTEXT)(text)


def _number(low: float | None = None, strict: bool = False):
    """A finite float flag, optionally bounded below; the error names the flag."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
        if low is not None and (value <= low if strict else value < low):
            raise argparse.ArgumentTypeError(
                f"must be {'>' if strict else '>='} {low:g}, got {value:g}"
            )
        return value

    return parse


def _add_run_flags(run: argparse.ArgumentParser) -> None:
    """Every flag of ``flare run``, each in its family (runtime/cli_groups.py)."""
    add_flag_groups(run)
    run._optionals.title = "general"
    run.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file with [scheduler] and [run] tables; flags given on the command line "
        "win (default: none)",
    )
    serving = flag_group(run, "serving")
    serving.add_argument("--host", metavar="HOST", default="127.0.0.1", help="HTTP bind address")
    serving.add_argument("--port", metavar="PORT", type=_port, default=8000, help="HTTP port")
    serving.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model id of the API (default: the directory name)",
    )
    serving.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template for /v1/chat/completions (default: the model directory's; "
        "without one a generic fallback, with a warning at start-up)",
    )
    serving.add_argument(
        "--max-choices-per-request",
        metavar="N",
        type=_positive,
        default=1024,
        help="the most choices (prompts x n) one HTTP request may ask for",
    )
    generation = flag_group(run, "generation")
    generation.add_argument(
        "--prompt",
        metavar="TEXT",
        help="generate one completion for TEXT, print it and exit (default: serve HTTP)",
    )
    generation.add_argument(
        "--max-tokens",
        metavar="N",
        type=_positive,
        default=32,
        help="--prompt: tokens to generate",
    )
    generation.add_argument(
        "--temperature",
        metavar="T",
        type=_number(0.0),
        default=0.0,
        help="--prompt: sampling temperature (0: greedy)",
    )
    generation.add_argument(
        "--top-p",
        metavar="P",
        type=_number(0.0, strict=True),
        default=1.0,
        help="--prompt: nucleus sampling mass, in (0, 1]",
    )
    generation.add_argument(
        "--top-k",
        metavar="N",
        type=_int_in(-1),
        default=-1,
        help="--prompt: top-k sampling, -1 for all",
    )
    generation.add_argument(
        "--seed", metavar="N", type=int, default=0, help="--prompt: sampling seed"
    )
    model = flag_group(run, "model")
    model.add_argument(
        "model_dir",
        nargs="?",
        metavar="MODEL_DIR",
        help="Hugging Face style model directory, as --model (default: the "
        "embedded model, created on first use)",
    )
    model.add_argument(
        "--model",
        metavar="DIR",
        help="model directory (default: the embedded model); the same as MODEL_DIR",
    )
    model.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="auto",
        help="weights and activations; auto is bfloat16 on CUDA and float32 on CPU",
    )
    model.add_argument(
        "--max-model-len",
        metavar="N",
        type=_model_len,
        help=f"context limit, >= {MIN_CONTEXT} (default: the model's max_position_embeddings)",
    )
    model.add_argument(
        "--enforce-eager",
        "--no-cuda-graphs",
        dest="enforce_eager",
        action="store_true",
        help="run programs eagerly, without CUDA graphs (--no-cuda-graphs is an alias)",
    )
    add_kv_flags(run, _positive)
    add_prefix_cache_flags(run)
    scheduling = flag_group(run, "scheduling")
    scheduling.add_argument(
        "--max-num-seqs",
        "--max-concurrency",
        metavar="N",
        dest="max_concurrency",
        type=_int_in(
            1,
            MAX_BATCH_CAPACITY,
            f" (the scheduler selects among at most {MAX_BATCH_CAPACITY} request slots)",
        ),
        default=DEFAULT_MAX_CONCURRENCY,
        help="resident request slots (--max-concurrency is an alias); requests also need "
        "their worst-case KV pages (prompt + max_tokens) to become resident",
    )
    scheduling.add_argument(
        "--max-prefill-tokens",
        "--max-num-batched-tokens",
        metavar="N",
        dest="max_prefill_tokens",
        type=_prefill_tokens,
        default=512,
        help=f"the largest prompt capacity of a prepared program (a multiple of "
        f"{PROMPT_ALIGNMENT}); longer prompts run in chunks. flare has no per-step "
        "token budget: --max-num-batched-tokens is an alias of this flag",
    )
    scheduling.add_argument(
        "--mixed-prefill",
        action="store_true",
        help="also capture mixed prefill/decode programs (one prompt chunk "
        "beside decode rows in one forward)",
    )
    scheduling.add_argument(
        "--scheduler-policy",
        choices=sorted(PRESETS),
        default=None,
        help="scheduling preset (default: balanced, or --config's [scheduler])",
    )
    scheduling.add_argument(
        "--scheduler-terminal-value",
        metavar="VALUE",
        type=float,
        help="the policy's terminal value (default: the preset's)",
    )
    scheduling.add_argument(
        "--scheduler-terminal-age-price",
        metavar="PRICE",
        type=float,
        help="the policy's terminal age price (default: the preset's)",
    )
    flag_group(run, "speculation").add_argument(
        "--mtp-adaptive-verification-alpha",
        metavar="ALPHA",
        type=_number(0.0, strict=True),
        help="the exponent on prefix-survival estimates in speculative selection scores "
        "(projections use the plain estimates; default: the preset's, 1)",
    )
    add_speculation_flags(run)
    deployment = flag_group(run, "deployment")
    deployment.add_argument(
        "-tp",
        "--tensor-parallel-size",
        metavar="N",
        type=_int_in(1, 64),
        default=1,
        help="ranks, one per device",
    )
    deployment.add_argument(
        "--device",
        metavar="{" + ",".join(DEVICE_CHOICES) + "}",
        type=parse_device,
        default="auto",
        help="auto is cuda when available; cuda runs rank r on cuda:r, cuda:N on cuda:N+r",
    )
    deployment.add_argument(
        "--startup-timeout",
        metavar="SECONDS",
        type=_number(0.0, strict=True),
        default=600.0,
        help="how long the ranks may take to load, prepare their programs and report",
    )
    deployment.add_argument(
        "--frame-timeout-multiple",
        metavar="X",
        type=_number(0.0, strict=True),
        default=20.0,
        help="a rank reports a hung frame after X times its expected duration "
        "+ --frame-timeout-margin",
    )
    deployment.add_argument(
        "--frame-timeout-margin",
        metavar="SECONDS",
        type=_number(0.0, strict=True),
        default=60.0,
        help="seconds added to every frame's hang deadline",
    )
    flag_group(run, "security").add_argument(
        "--api-key",
        metavar="KEY[,KEY...]",
        action="append",
        default=None,
        help="require one of these bearer keys on every route but /health and /version: "
        "a key, a comma-separated list, or the flag repeated; with several keys each key "
        "is a tenant with its own prefix-cache salt, so tenants never share cached pages "
        "(default: $FLARE_API_KEY, read the same way, else none)",
    )
    add_run_flags(run)
    add_debug_flags(run)
    add_liveness_flags(run)
    add_identity_flags(run)
    add_deploy_flags(run)
    add_serving_flags(run)
    add_transport_flags(run)
    # Set by the frontend for its coordinator process (python -m runtime.coordinator).
    run.add_argument("--api-requests", help=argparse.SUPPRESS)
    run.add_argument("--api-outputs", help=argparse.SUPPRESS)
    run.add_argument("--api-debug", help=argparse.SUPPRESS)


# The top-level --help (the module docstring is for readers of the code).
DESCRIPTION = (
    "flare: a tensor-parallel LLM serving runtime. `flare run` serves a model over an "
    "OpenAI-compatible HTTP API, or generates one completion with --prompt; `flare bench` "
    "load-tests a server."
)
RUN_USAGE = "%(prog)s [MODEL_DIR] [--prompt TEXT] [OPTIONS]"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="flare",
        description=DESCRIPTION,
        epilog="`flare COMMAND --help` lists a command's flags.",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=Parser, metavar="COMMAND", title="commands"
    )
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
    _add_run_flags(run)
    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint", add_help=False)
    bench.add_argument("args", nargs=argparse.REMAINDER)
    add_trace_command(sub, Parser, HelpFormatter)
    add_replay_command(sub, Parser, HelpFormatter)
    add_ranks_command(sub, Parser, HelpFormatter)
    add_keys_command(sub, Parser, HelpFormatter)
    return parser


def _run_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``run`` subcommand's parser (``parser`` itself when it is that one)."""
    if parser._subparsers is None:
        return parser
    return parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]


def _explicit(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations of the run flags given on the command line."""
    given = set()
    for action in _run_parser(parser)._actions:
        for option in action.option_strings:
            if any(arg == option or arg.startswith(option + "=") for arg in argv):
                given.add(action.dest)
    return given


def _apply_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser, argv) -> dict:
    """Fill flags not given on the command line from ``--config``'s [run]; its data.

    A [run] key is any long flag name (an alias too: ``max-num-seqs`` or
    ``max-concurrency``), without the dashes in front.
    """
    if not args.config:
        return {}
    try:
        with open(args.config, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        parser.error(f"--config {args.config}: {exc}")
    unknown = set(data) - {"run", "scheduler"}
    if unknown:
        parser.error(f"--config {args.config}: unknown table(s) {sorted(unknown)}")
    run = data.get("run", {})
    if not isinstance(run, dict):
        parser.error(f"--config {args.config}: [run] must be a table")
    actions = {
        option[2:]: action
        for action in _run_parser(parser)._actions
        for option in action.option_strings
        if option.startswith("--")
    }
    given = _explicit(parser, argv)
    if args.model_dir is not None:
        given.add("model")
    seen: dict[str, str] = {}
    for key, value in run.items():
        action = actions.get(key) or actions.get(key.replace("_", "-"))
        dest = action.dest if action is not None else None
        if action is None or dest in ("config", "api_requests", "api_outputs", "api_debug", "help"):
            parser.error(f"--config {args.config}: unknown [run] key {key!r}")
        if dest in seen:
            parser.error(f"--config {args.config}: [run] {seen[dest]} and {key} set the same flag")
        seen[dest] = key
        if dest in given:
            continue
        try:
            if action.type is not None:
                value = action.type(str(value))
            elif action.choices is not None and value not in action.choices:
                raise argparse.ArgumentTypeError(f"must be one of {sorted(action.choices)}")
            elif action.nargs == 0 and not isinstance(value, bool):  # a switch
                raise argparse.ArgumentTypeError(f"must be true or false, got {value!r}")
            elif action.nargs == 0 and isinstance(action, argparse.BooleanOptionalAction):
                # no-enable-prefix-caching = true: the --no- form turns the switch off
                value = value != key.replace("_", "-").startswith("no-")
            elif action.nargs != 0 and not isinstance(value, str):
                raise argparse.ArgumentTypeError(f"must be a string, got {value!r}")
        except (argparse.ArgumentTypeError, ValueError) as exc:
            parser.error(f"--config {args.config}: [run] {key}: {exc}")
        setattr(args, dest, value)
    return data


def _policy(args: argparse.Namespace, parser: argparse.ArgumentParser, data: dict) -> PolicyConfig:
    terminal = {
        "terminal_value": args.scheduler_terminal_value,
        "terminal_age_price": args.scheduler_terminal_age_price,
    }
    terminal["adaptive_verification_alpha"] = args.mtp_adaptive_verification_alpha
    terminal = {k: v for k, v in terminal.items() if v is not None}
    try:
        if args.scheduler_policy is None and "scheduler" in data:
            base = PolicyConfig.from_toml(args.config)
            return dataclasses.replace(base, **terminal)  # validates again
        return PolicyConfig.preset(args.scheduler_policy or "balanced", **terminal)
    except (ConfigError, TypeError) as exc:
        parser.error(f"--scheduler-* / --config: {exc}")
        raise  # unreachable


def _model_dir(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, str]:
    """The model directory and how the command line named it (for messages)."""
    positional, flag = args.model_dir, args.model
    if (
        positional is not None
        and flag is not None
        and os.path.realpath(positional) != os.path.realpath(flag)
    ):
        parser.error(
            f"MODEL_DIR {positional} and --model {flag} name different directories; "
            "give one of them"
        )
    if positional is not None:
        return positional, f"MODEL_DIR {positional}"
    if flag is not None:
        return flag, f"--model {flag}"
    from runtime.ranks.model import default_model_dir

    path = str(default_model_dir())
    return path, f"the default model {path}"


def _split_keys(value: str) -> list[str]:
    return [key.strip() for key in value.split(",") if key.strip()]


def _api_keys(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """The API keys: ``--api-key`` (repeated, or comma-separated; a [run] ``api-key``
    string too), else ``$FLARE_API_KEY`` read the same way (empty: none)."""
    given = args.api_key
    if isinstance(given, tuple):  # already checked
        return given
    if given is None:
        return tuple(dict.fromkeys(_split_keys(os.environ.get("FLARE_API_KEY") or "")))
    values = [given] if isinstance(given, str) else list(given)
    if any(not _split_keys(value) for value in values):
        parser.error("--api-key: give a key or a comma-separated list of keys, not an empty value")
    return tuple(dict.fromkeys(key for value in values for key in _split_keys(value)))


def _check_chat_template(path: str | None, parser: argparse.ArgumentParser) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        parser.error(f"--chat-template {path}: cannot be read ({reason}); give a Jinja file")
    return os.path.abspath(path)


def checked_run(
    args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str] | None = None
) -> tuple[DeploymentConfig, ModelConfig]:
    """The deployment ``flare run`` asks for and its model's config.

    Every flag and model-directory problem fails here, before any process
    starts, in one line naming the flag or file (``parser.error``: exit 2).
    The model check reads ``config.json`` and looks for the tokenizer and
    weight files; it loads no weight.
    """
    parser = _run_parser(parser)  # errors read "flare run: error: ..."
    data = _apply_config_file(args, parser, argv or [])
    for dest, feature in NOT_YET.items():
        if getattr(args, dest) is not None:
            flag = "--" + dest.replace("_", "-")
            parser.error(f"{flag}: {feature} are not available in this build yet")
    policy = _policy(args, parser, data)
    external = external_ranks(args, parser, _explicit(parser, argv or []))
    if external is not None:
        args.tensor_parallel_size = external.world_size
    if not 0 < args.startup_timeout < float("inf"):
        parser.error("--startup-timeout must be a finite number of seconds > 0")
    args.chat_template = _check_chat_template(args.chat_template, parser)
    args.api_key = _api_keys(args, parser)
    try:
        args.trace = check_trace_path(args.trace)
    except ValueError as exc:
        parser.error(str(exc))
    model_dir, named = _model_dir(args, parser)
    if not os.path.exists(model_dir):
        parser.error(f"{named}: no such directory")
    if not os.path.isdir(model_dir):
        parser.error(f"{named}: not a directory")
    from runtime.ranks.model.errors import LoadError, ModelConfigError
    from runtime.ranks.model.loader import check_model_dir

    try:
        model = check_model_dir(model_dir)
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
    context = args.max_model_len or limit
    if context < MIN_CONTEXT:
        parser.error(
            f"{named}: max_position_embeddings {limit} is below {MIN_CONTEXT}, the shortest "
            "context flare serves"
        )
    try:
        config = DeploymentConfig(
            model=model_dir,
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
            policy=policy,
            cuda_graphs=not args.enforce_eager,
            mixed_prefill=bool(args.mixed_prefill),
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
        )
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable
    pool = kv_pool(config, model)
    try:
        if pool is not None:  # else the ranks check theirs at start-up
            pool.check(context, args.max_model_len)
    except KVCacheSizeError as exc:
        parser.error(str(exc))
    return config, model


def deployment_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str] | None = None
) -> DeploymentConfig:
    """The deployment ``flare run`` asks for; fails fast naming the bad flag."""
    return checked_run(args, parser, argv)[0]


def _sampling(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SamplingParams:
    try:
        return SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    except ProtocolError as exc:
        parser.error(f"--{exc.field.replace('_', '-')}: {exc.reason}")
        raise  # unreachable
    except ValueError as exc:
        parser.error(f"sampling flags: {exc}")
        raise  # unreachable


def _tokenizer(model_dir: str, parser: argparse.ArgumentParser):
    """The model's tokenizer, or a one-line error naming the file."""
    from tokenizers import Tokenizer

    path = os.path.join(model_dir, "tokenizer.json")
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the tokenizers library raises plain Exceptions
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        parser.error(f"{path}: not a tokenizers tokenizer.json ({reason})")


def _check_prompt(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    config: DeploymentConfig,
    pool: KVPool | None,
    context: int,
    ids: list[int],
) -> None:
    """``--prompt`` + ``--max-tokens`` must fit the context and the KV pool (when known)."""
    if not ids:
        parser.error("--prompt encodes to no tokens")
    total = len(ids) + args.max_tokens
    request = f"--prompt ({len(ids)} tokens) + --max-tokens {args.max_tokens} = {total} tokens"
    if total > context:
        parser.error(f"--max-tokens {args.max_tokens}: {request} exceed the context of {context}")
    pages = -(-total // config.page_size)
    if pool is not None and pages > pool.num_pages:
        parser.error(
            f"{pool.origin}: {request} need {pages} KV pages of {config.page_size} tokens, "
            f"the pool holds {pool.num_pages}; raise {pool.flag} or lower --max-tokens"
        )


def completion_text(tokenizer, prompt_ids: list[int], out: list[int]) -> str:
    """The completion's text as it continues the prompt: decoded together with the
    prompt and cut after it (a token's leading space survives), else on its own."""
    prefix = tokenizer.decode(prompt_ids)
    whole = tokenizer.decode(prompt_ids + out)
    return whole[len(prefix) :] if whole.startswith(prefix) else tokenizer.decode(out)


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms"


def describe_summary(summary: dict) -> str:
    """The engine's frame figures (``EngineStats.summary``) in words, one line."""
    frames = summary.get("frames", 0)
    parts = [f"{frames} frame{'s' if frames != 1 else ''}"]
    if "mean_device_ns" in summary:
        parts[0] += f", {_ms(summary['mean_device_ns'])} of device time each"
    overhead = []
    if "host_overhead_ratio" in summary:
        alone = f"host {100 * (summary['host_overhead_ratio'] - 1):.1f}% per frame"
        if "round_trip_ns" in summary:
            alone += f" ({_ms(summary['round_trip_ns'])} round trip)"
        overhead.append(alone)
    if "busy_overhead_ratio" in summary:
        overhead.append(f"{100 * (summary['busy_overhead_ratio'] - 1):.1f}% over the busy span")
    if overhead:
        parts.append("overhead over device time: " + ", ".join(overhead))
    return "; ".join(parts)


# --prompt prints labelled blocks: the labels, the prompt and the figures on
# stderr, the completion alone on stdout (so `> FILE` keeps only the completion).
LABEL = "==>"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def generate_once(
    args: argparse.Namespace, config: DeploymentConfig, sampling, tokenizer, ids: list[int]
) -> int:
    """``--prompt``: one completion in this process, printed apart from the prompt.

    On stderr the start-up summary, ``==> prompt (N tokens)`` and the prompt, then
    ``==> completion (N generated tokens in T ms, finish: REASON)``; on stdout the
    completion alone; last, on stderr, ``==> figures: ...`` (:func:`describe_summary`).
    """
    started = time.monotonic()
    deployment = LocalDeployment(config)
    tracing = trace_options(args)
    if tracing is not None:
        deployment.engine.enable_trace(tracing)
    try:
        deployment.start()
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a rank died, a timeout: one line, the ranks said why
        print(f"flare: start-up failed: {exc}", file=sys.stderr)
        return 1
    try:
        engine = deployment.engine
        facts = engine.facts
        log.info("coordinator at %s", engine.endpoints.frames)
        _say(
            f"flare: serving {facts.model_name} with TP={config.tensor_parallel_size}, "
            f"catalog of {describe_counts(facts.descriptors)}, "
            f"ready in {time.monotonic() - started:.1f} s"
        )
        t0 = time.monotonic()
        stream = engine.submit(ids, args.max_tokens, sampling)
        out: list[int] = []
        for event in stream:
            out += event.token_ids
        seconds = time.monotonic() - t0
        _say(f"{LABEL} prompt ({len(ids)} tokens)")
        _say(args.prompt)
        _say(
            f"{LABEL} completion ({len(out)} generated tokens in {seconds * 1e3:.0f} ms, "
            f"finish: {stream.finish_reason})"
        )
        print(completion_text(tokenizer, ids, out), flush=True)
        summary = engine.stats.summary()
    finally:
        deployment.stop()
    trace = deployment.engine.trace
    if trace is not None:
        counters = trace.counters()
        _say(
            f"trace: {counters['trace_lines']} frames written to {args.trace} "
            f"({counters['trace_dropped']} dropped)"
        )
    _say(f"{LABEL} figures: {describe_summary(summary)}")
    if stream.finish_reason == "error":  # the engine failed: the log above says why
        print(f"flare: the engine failed: {stream.error}", file=sys.stderr)
        return 1
    return 0


def _without_secrets(argv: list[str]) -> tuple[str, ...]:
    """``argv`` minus ``--api-key``: the coordinator does not need it, and a child's
    command line is visible to every local user."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--api-key":
            skip = True
        elif not arg.startswith("--api-key="):
            out.append(arg)
    return tuple(out)


def configure_logging(level: str, process: str) -> None:
    """This process's log lines, ``[process] LEVEL message`` at ``--log-level``
    (warning unless asked), a flood of one message a burst and a count; a no-op
    where logging is set up already (a test)."""
    from runtime.logs import basic_config

    basic_config(level.upper(), f"[{process}] %(levelname)s %(message)s")


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """``flare run`` / ``flare serve``: every check first, then the processes."""
    parser = _run_parser(parser)
    # --prompt: the engine runs here; serving: this process is the frontend.
    configure_logging(args.log_level, "flare" if args.prompt is not None else "frontend")
    config, model = checked_run(args, parser, argv)
    sampling = _sampling(args, parser)
    tokenizer = _tokenizer(config.model, parser)
    context = min(model.max_position_embeddings, config.max_model_len or 1 << 62)
    pool = kv_pool(config, model)
    if args.prompt is not None:
        ids = tokenizer.encode(args.prompt).ids
        _check_prompt(args, parser, config, pool, context, ids)
    shortfall = pool.shortfall(context) if pool is not None else None
    if shortfall is not None:  # every check passed: a warning, then the start
        log.warning(shortfall)
    if args.prompt is not None:
        return generate_once(args, config, sampling, tokenizer, ids)
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
            coordinator_args=_without_secrets(argv),
            chat_template=args.chat_template,
            max_choices_per_request=args.max_choices_per_request,
            debug_endpoints=args.debug_endpoints,
            log_level=args.log_level,
            **serving_options(args, parser),
        )
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["bench"]:
        from runtime.loadgen.cli import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command in ("run", "serve"):
        return cmd_run(args, parser, argv[1:])
    if args.command == "trace":
        return cmd_trace(args)
    if args.command == "replay":
        return cmd_replay(args)
    if args.command == "keys":
        return cmd_keys(args)
    if args.command == "ranks":
        return cmd_ranks(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
