"""Speculative decoding through the whole runtime on CPU (coordinator + rank
processes, gloo at TP=2, real sockets): greedy output equals transformers'
greedy decoding without speculation, for draft-model and copy proposals, fixed
and adaptive selection, with the ranks checking each other's tokens; and the
scheduler's acceptance estimates move on a real run."""

from __future__ import annotations

import random
import threading

import pytest

from runtime.deploy.config import DeploymentConfig
from runtime.deploy.local import LocalDeployment
from runtime.speculation import SpeculationConfig
from runtime.transport.sampling import SamplingParams
from tests.support.checkpoints import greedy, write_tiny

pytestmark = pytest.mark.process

NEW = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    target = tmp_path_factory.mktemp("target")
    other = tmp_path_factory.mktemp("draft")
    hf = write_tiny("llama", target, seed=21)
    write_tiny("llama", other, seed=22)
    rng = random.Random(5)
    prompts = [[rng.randrange(120) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    prompts.append([7, 8, 9, 10] * 6)  # repetitive: copy proposals find matches
    return target, other, prompts, greedy(hf, prompts, NEW)


def deployment(
    path, tp: int, speculation: SpeculationConfig | None, mixed: bool = False
) -> LocalDeployment:
    return LocalDeployment(
        DeploymentConfig(
            model=str(path), tensor_parallel_size=tp, max_concurrency=8,
            max_prefill_tokens=64, num_pages=256, device="cpu", startup_timeout_s=120,
            check_ranks=True, speculation=speculation, mixed_prefill=mixed,
        )
    )  # fmt: skip


@pytest.mark.parametrize(
    ("tp", "proposer", "draft", "selection", "mixed"),
    [
        (1, "copy", None, "fixed", False),
        (1, "draft", "other", "adaptive", False),
        (1, "draft", "target", "fixed", True),
        (2, "copy", None, "adaptive", False),
        (2, "draft", "target", "fixed", False),
        (2, "draft", "other", "adaptive", True),
    ],
)
def test_greedy_speculative_decoding_gives_greedy_decodings_tokens(
    checkpoints, tp, proposer, draft, selection, mixed
):
    target, other, prompts, expected = checkpoints
    draft_dir = {"target": str(target), "other": str(other), None: None}[draft]
    spec = SpeculationConfig(proposer, draft_dir, num_speculative_tokens=3, selection=selection)
    with deployment(target, tp, spec, mixed) as d:
        catalog = d.engine.scheduler.catalog.descriptors
        kinds = {desc.kind.value for desc in catalog}
        if mixed:  # wide mixed programs: a prompt row beside verifying decoders
            assert any(desc.kind.value == "mixed" and desc.token_capacity > 1 for desc in catalog)
        streams = [d.engine.submit(p, NEW, ignore_eos=True) for p in prompts]
        got = [s.result(timeout=300).token_ids for s in streams]
        executed = d.engine.stats.summary()
        frames = d.engine.stats.frames()
    assert "speculative" in kinds
    assert got == expected
    assert executed["frames"] > 0
    rounds = [f for f in frames if f.graph.startswith("speculative")]
    assert rounds  # speculative programs ran
    wide = [f for f in frames if f.graph.startswith("mixed") and " W=1 " not in f.graph]
    assert wide or not mixed  # a prompt row and verifying decoders shared a forward
    if draft == "target":  # every proposal accepted: fewer frames than tokens
        assert len(frames) < len(prompts) * NEW / 2


def test_acceptance_estimates_move_on_a_real_run(checkpoints):
    """Copy proposals on greedy output of a repetitive prompt (the tiny model falls
    into loops of its own) are often accepted; on sampled output at temperature
    1 (near-uniform over the vocabulary) almost never: the request's depth-one
    acceptance mean falls from its 0.5 prior towards 0 there and stays well
    above that on the greedy run."""
    target, _, prompts, _ = checkpoints
    spec = SpeculationConfig("copy", num_speculative_tokens=3, selection="fixed")
    means: dict[str, list[float]] = {"greedy": [], "sampled": []}
    with deployment(target, 1, spec) as d:
        engine = d.engine
        lock = threading.Lock()

        def watch(name):
            def listener(stream, event):  # on the engine thread: the scheduler is quiet
                for r in engine.scheduler.active_requests():
                    if r.speculation is not None:
                        with lock:
                            means[name].append(r.speculation.acceptance("copy").means(1)[0])

            return listener

        repetitive = prompts[-1]
        engine.submit(repetitive, 64, ignore_eos=True, listener=watch("greedy")).result(300)
        sampled = SamplingParams(temperature=1.0, seed=1)
        engine.submit(prompts[0], 64, sampled, ignore_eos=True, listener=watch("sampled")).result(
            300
        )
    assert means["greedy"] and means["sampled"]
    assert means["sampled"][-1] < 0.15  # from the 0.5 prior down towards 0
    assert means["greedy"][-1] > means["sampled"][-1] + 0.15


def test_an_acceptance_prior_preseeds_the_population(checkpoints):
    """``--speculative-acceptance-prior``: requests start from the given survival
    means instead of 0.5^d (deeper depths keep 0.5^d)."""
    target, _, prompts, _ = checkpoints
    spec = SpeculationConfig("copy", num_speculative_tokens=3, acceptance_prior=(0.9, 0.7))
    with deployment(target, 1, spec) as d:
        means = d.engine.scheduler.speculation.prior("copy").means()
        d.engine.submit(prompts[0], 4, ignore_eos=True).result(timeout=300)
    assert means == pytest.approx([0.9, 0.7, 0.125])
