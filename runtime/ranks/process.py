"""The body of a rank process (``torchrun --nproc-per-node N -m runtime.ranks ...``),
after its flags (runtime/cli/rank_process.py).

Each rank joins ``torch.distributed`` (``nccl`` on CUDA, ``gloo`` on CPU) from
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
loads its weight shard, sizes its KV cache (:func:`size_kv_cache`, on CUDA by
measuring the device; ``runtime.ranks.memory``), prepares the program catalog
(on CUDA rank 0 shows the graph capture's progress on a terminal), connects to
the coordinator's endpoints, reports its catalog and serves frames until the
coordinator says shutdown.  The coordinator is a process of its own (``flare
run`` starts both on one machine); ranks find it through ``--frames-endpoint`` /
``--completions-endpoint`` / ``--heartbeat-endpoint`` or the environment
variables FLARE_FRAMES_ENDPOINT / FLARE_COMPLETIONS_ENDPOINT /
FLARE_HEARTBEAT_ENDPOINT.  A rank that hears no heartbeat from the coordinator
for ``--heartbeat-timeout`` seconds logs why and exits (code 4).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from runtime.deploy.devices import first_cuda_index, rank_device_problem
from runtime.identity import IdentityError, collective_fingerprint, model_identity
from runtime.logs import install_rate_limit
from runtime.private_files import make_private_dirs, open_private
from runtime.ranks import memory
from runtime.ranks.frame_loop import serve_frames
from runtime.ranks.memory import DeviceMemory, KVCacheSizeError, KVPool
from runtime.ranks.model import (
    LlamaForCausalLM,
    LoadError,
    ModelConfigError,
    TPGroup,
    default_model_dir,
    load_model,
)
from runtime.ranks.worker import RankWorker
from runtime.transport.channels import ChannelEndpoints
from runtime.transport.liveness import LivenessConfig, RankHeartbeat
from runtime.transport.rank_channel import RankChannel

log = logging.getLogger("runtime.ranks")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def draft_dir(name: str) -> str:
    """``--draft-model``: a directory, or ``default`` for the embedded draft."""
    if name == "default":
        from runtime.ranks.model import default_draft_dir

        return str(default_draft_dir())
    return name


def configure_logging(rank: int, level: str, log_dir: str | None) -> None:
    """Every line names the rank and the pid; with ``log_dir``, a file per rank
    too (``rank<r>.log``, created 0600 in a directory created 0700)."""
    fmt = f"[rank {rank} pid {os.getpid()}] %(asctime)s %(levelname)s %(name)s: %(message)s"
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_dir:
        make_private_dirs(log_dir)
        fd = open_private(os.path.join(log_dir, f"rank{rank}.log"), truncate=False)
        handlers.append(logging.StreamHandler(os.fdopen(fd, "a", encoding="utf-8")))
    logging.basicConfig(level=level.upper(), format=fmt, handlers=handlers, force=True)
    for handler in handlers:  # a flood of one message is a burst and a count
        install_rate_limit(handler)


def _select_device(args: argparse.Namespace, local_rank: int, world_size: int) -> torch.device:
    """This rank's device, made current (CUDA), or the CPU with this rank's share of
    the cores."""
    use_cuda = args.device != "cpu" and (args.device != "auto" or torch.cuda.is_available())
    cuda_index = first_cuda_index(args.device) + local_rank
    if use_cuda:
        torch.cuda.set_device(cuda_index)
        return torch.device("cuda", cuda_index)
    # CPU ranks share the machine's cores with each other and with the
    # coordinator: leave it one core and split the rest, since oversubscribed
    # intra-op threads turn every collective into a scheduling stall.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, ((cores or 1) - 1) // local_world))
    return torch.device("cpu")


def _join_group(rank: int, world_size: int, use_cuda: bool) -> TPGroup:
    """The tensor-parallel group: torch.distributed across the ranks (nccl on CUDA,
    gloo on CPU), or a group of one."""
    if world_size == 1:
        return TPGroup.single()
    backend = "nccl" if use_cuda else "gloo"
    init_method = os.environ.get("FLARE_DIST_INIT_METHOD")  # local ranks: a file store
    if init_method:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    else:  # torchrun's environment (MASTER_ADDR, MASTER_PORT or its rendezvous)
        dist.init_process_group(backend=backend)
    return TPGroup.from_process_group()


def _load_models(
    args: argparse.Namespace, rank: int, group: TPGroup, dtype: torch.dtype, device: torch.device
) -> tuple[str, LlamaForCausalLM] | None:
    """The model directory and this rank's shard of the model (``args.draft``, the
    draft's, and ``args.identity`` / ``args.draft_identity`` set); None: a problem,
    said on stderr in one line."""
    model_dir = args.model or str(default_model_dir())
    try:
        model = load_model(model_dir, group, dtype=dtype, device=device)
    except (ModelConfigError, LoadError) as exc:  # one line, not a traceback per rank
        print(f"rank {rank}: model {model_dir}: {exc}", file=sys.stderr)
        return None
    args.draft = None
    if args.draft_model:
        path = draft_dir(args.draft_model)
        try:  # tensor-parallel over the same group, like the target
            args.draft = load_model(path, group, dtype=dtype, device=device)
        except (ModelConfigError, LoadError) as exc:
            print(f"rank {rank}: draft model {path}: {exc}", file=sys.stderr)
            return None
    try:  # what the start-up agreement compares (runtime/identity.py)
        args.identity = model_identity(model_dir, full_weights=args.verify_weights)
        args.draft_identity = None
        if args.draft_model:
            args.draft_identity = model_identity(
                draft_dir(args.draft_model), full_weights=args.verify_weights
            )
    except IdentityError as exc:
        print(f"rank {rank}: {exc}", file=sys.stderr)
        return None
    return model_dir, model


def run(args: argparse.Namespace) -> int:
    """The rank process after its flags (runtime/cli/rank_process.py): join the
    group, load the shard, prepare the catalog, serve frames until shutdown."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    configure_logging(rank, args.log_level, args.log_dir)
    problem = rank_device_problem(args.device, local_rank)
    if problem is not None:  # one line, not torch's traceback
        print(f"rank {rank}: {problem}", file=sys.stderr)
        return 2
    device = _select_device(args, local_rank, world_size)
    use_cuda = device.type == "cuda"
    if args.dtype != "auto":
        dtype = TORCH_DTYPES[args.dtype]
    else:
        dtype = torch.bfloat16 if use_cuda else torch.float32
    group = _join_group(rank, world_size, use_cuda)
    try:
        return _serve(args, rank, world_size, group, dtype, device)
    finally:
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _serve(
    args: argparse.Namespace,
    rank: int,
    world_size: int,
    group: TPGroup,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Load, prepare, connect and serve; the channel and the heartbeat close on the way out."""
    use_cuda = device.type == "cuda"
    channel = None
    heartbeat: RankHeartbeat | None = None
    try:
        loaded = _load_models(args, rank, group, dtype, device)
        if loaded is None:
            return 1
        model_dir, model = loaded
        if world_size > 1 and not same_model_as_peers(args, model, device):
            # Collectives over mismatched shapes or dtypes hang or corrupt: run none
            # (no graph capture, no device profiling), report, and let the
            # coordinator's start-up agreement name the difference.
            log.warning("the ranks loaded different models or dtypes; preparing eagerly")
            args.no_cuda_graphs = True
            if use_cuda and args.num_pages is None and args.kv_cache_memory is None:
                context = min(model.config.max_position_embeddings, args.max_model_len or 1 << 62)
                args.num_pages = -(-context // args.page_size)
        capture = use_cuda and not args.no_cuda_graphs
        progress = preparation_bar if rank == 0 and capture else None
        try:
            worker = build_worker(args, model, model_dir, use_cuda, progress)
            counts = catalog_counts(worker)
            log.info("on %s: %s; %d KV pages", worker.device, counts, worker.num_pages)
        except KVCacheSizeError as exc:  # one line, not a traceback per rank
            print(f"rank {rank}: {exc}", file=sys.stderr)
            return 1
        endpoints = ChannelEndpoints(
            args.frames_endpoint, args.completions_endpoint, args.heartbeat_endpoint or ""
        )
        channel = RankChannel(endpoints, rank, keys=args.transport_client_keys)
        channel.handshake(timeout_ms=int(args.handshake_timeout * 1000))
        heartbeat = start_heartbeat(channel, rank, args)
        serve_frames(worker, channel, spin_us=args.poll_spin_us)
        if heartbeat is not None:  # the coordinator stops its heartbeats at shutdown
            heartbeat.close()
        del worker, model  # captured graphs and buffers go before the process group
        if use_cuda:
            torch.cuda.synchronize()
    finally:
        if heartbeat is not None:  # its socket goes before the channel's context
            heartbeat.close()
        if channel is not None:
            channel.close(linger_ms=1000)
    return 0


def preparation_bar(items: Iterable) -> Iterable:
    """Rank 0's bar while it captures its programs as CUDA graphs (on a terminal
    only): the count and the elapsed time, no rate (programs differ in cost by
    orders of magnitude, so a programs-per-second figure says nothing)."""
    from tqdm import tqdm

    return tqdm(
        items,
        desc="capturing CUDA graphs",
        bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {elapsed}",
        disable=None,  # not when stderr is a pipe or a file
    )


def catalog_counts(worker: RankWorker) -> str:
    """What the catalog holds, in the words the coordinator's summary uses
    (:func:`runtime.catalog.describe_counts`): the prepared forward programs (and
    how many are CUDA graphs) and the state programs, which have no body."""
    from runtime.catalog import describe_counts

    captured = sum(p.captured for p in worker.programs.values())
    captured += sum(p.captured for p in worker.vision.values())  # a vision model's encoders
    return f"catalog of {describe_counts(worker.catalog)}, {captured} captured as CUDA graphs"


def start_heartbeat(
    channel: RankChannel, rank: int, args: argparse.Namespace
) -> RankHeartbeat | None:
    """This rank's heartbeat thread (runtime/transport/liveness.py): it exits the
    process when the coordinator falls silent for ``--heartbeat-timeout``."""
    sock = channel.open_heartbeat_socket()
    if sock is None:
        # A rank its launcher started on this machine (runtime.deploy.launch.spawn_ranks:
        # `flare replay`, tests) dies with that launcher; one torchrun started needs
        # the heartbeats to notice a coordinator that is gone.
        local = "FLARE_DIST_INIT_METHOD" in os.environ  # set by spawn_ranks
        log.log(
            logging.INFO if local else logging.WARNING,
            "rank %d: no --heartbeat-endpoint: this rank cannot notice a coordinator "
            "that is gone%s",
            rank,
            " (it ends with the process that started it)"
            if local
            else ", and the coordinator learns of its death only by its silence",
        )
        return None
    heartbeat = RankHeartbeat(
        sock,
        rank,
        LivenessConfig(args.heartbeat_interval, args.heartbeat_timeout),
        endpoint=args.heartbeat_endpoint,
    )
    heartbeat.start()
    return heartbeat


def same_model_as_peers(
    args: argparse.Namespace, model: LlamaForCausalLM, device: torch.device
) -> bool:
    """Every rank loaded the same config and weight shapes in the same dtype (a
    32-byte fingerprint gathered from each; ``runtime.identity``)."""
    dtype = str(model.dtype).removeprefix("torch.")
    fingerprint = collective_fingerprint(args.identity, args.draft_identity, dtype)
    mine = torch.tensor(list(fingerprint), dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return all(torch.equal(peer, mine) for peer in gathered)


def build_worker(
    args: argparse.Namespace,
    model: LlamaForCausalLM,
    model_dir: str,
    use_cuda: bool,
    progress: Callable[[Iterable], Iterable] | None,
) -> RankWorker:
    """Size the KV cache (:func:`size_kv_cache`), then prepare the worker; under the
    utilization rule, check what its programs took against what the budget left
    them.  Raises KVCacheSizeError naming the numbers."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    max_context = min(model.config.max_position_embeddings, args.max_model_len or 1 << 62)
    pool, measured = size_kv_cache(args, model, world_size, use_cuda, max_context)
    if rank == 0:
        log.info("KV cache: %d pages of %d tokens; %s", pool.num_pages, pool.page_size, pool.origin)
    device = model.model.embed_tokens.weight.device
    used_before = memory.device_used_bytes(device) if measured is not None else 0
    try:
        worker = RankWorker(
            model,
            args.capacity,
            num_pages=pool.num_pages,
            page_size=args.page_size,
            rank=rank,
            world_size=world_size,
            model_name=os.path.basename(os.path.normpath(model_dir)),
            capture=use_cuda and not args.no_cuda_graphs,
            progress=progress,
            max_model_len=args.max_model_len,
            frame_timeout_multiple=args.frame_timeout_multiple,
            frame_timeout_margin_s=args.frame_timeout_margin,
            check_ranks=args.check_ranks,
            profile_dir=args.profile_dir,
            draft_model=getattr(args, "draft", None),
            proposer=args.proposer_config,
            identity=getattr(args, "identity", None),
            draft_identity=getattr(args, "draft_identity", None),
            kv_page_bytes=pool.page_bytes,
        )
    except torch.cuda.OutOfMemoryError:
        raise KVCacheSizeError(
            f"{pool.origin}: out of device memory preparing programs beside a KV cache of "
            f"{pool.num_pages} pages ({pool.num_pages * pool.page_bytes} bytes); lower "
            f"{pool.flag}"
        ) from None
    if measured is not None:
        kv = memory.kv_cache_bytes(pool.num_pages, pool.page_bytes, pool.page_size)
        programs = memory.device_used_bytes(device) - used_before - kv
        try:
            memory.check_programs_fit(measured, programs)
        except KVCacheSizeError:
            del worker  # its graphs go before the process group
            raise
    return worker


def size_kv_cache(
    args: argparse.Namespace,
    model: LlamaForCausalLM,
    world_size: int,
    use_cuda: bool,
    max_context: int,
) -> tuple[KVPool, DeviceMemory | None]:
    """This rank's KV pool (``runtime.ranks.memory``), checked to hold one request;
    with the device measurement when the utilization rule sized it (CUDA only).

    Measured budgets differ between devices: the ranks agree on the smallest
    pool (the coordinator requires one page count).
    """
    page_bytes = memory.kv_bytes_per_page(
        model.config, world_size, args.page_size, model.dtype.itemsize
    )
    draft = getattr(args, "draft", None)
    if draft is not None:  # the draft's cache uses the same page ids
        page_bytes += memory.kv_bytes_per_page(
            draft.config, world_size, args.page_size, draft.dtype.itemsize
        )
    measured = None
    if use_cuda and args.num_pages is None and args.kv_cache_memory is None:
        measured = memory.profile_cuda(
            model, args.capacity, max_context, args.page_size, args.gpu_memory_utilization
        )
    pool = memory.plan_pool(
        page_bytes,
        args.page_size,
        num_pages=args.num_pages,
        kv_cache_memory=args.kv_cache_memory,
        device_budget=measured,
    )
    if measured is not None and world_size > 1:
        pages = torch.tensor([pool.num_pages], dtype=torch.int64, device="cuda")
        dist.all_reduce(pages, op=dist.ReduceOp.MIN)
        pool = dataclasses.replace(pool, num_pages=int(pages.item()))
    pool.check(max_context, args.max_model_len)
    shortfall = pool.shortfall(max_context) if measured is not None else None
    if shortfall is not None and int(os.environ.get("RANK", "0")) == 0:
        log.warning(shortfall)  # else flare run said it before the ranks started
    return pool, measured
