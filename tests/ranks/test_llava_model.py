"""The LLaVA rank model against transformers' LlavaForConditionalGeneration, at TP=1
and TP=2 (gloo).

Two tiny random checkpoints are written with transformers: ``split`` (a Llama
decoder; a CLIP encoder of 4 heads and intermediate 128, tensor-parallel at TP=2;
``vision_feature_layer`` -2, ``"default"`` strategy) and ``replicated`` (a Qwen2
decoder; a CLIP encoder of 3 heads and intermediate 100, replicated at TP=2; layer
-1, ``"full"`` strategy, no projector bias, tanh GELU). The same scenario runs in
this process (TP=1) and in two spawned gloo ranks (TP=2), through the paged KV
cache with the image features substituted at the image tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.ranks.model.attention import AttentionMetadata
from runtime.ranks.model.checkpoint import check_model_dir
from runtime.ranks.model.errors import LoadError, ModelConfigError
from runtime.ranks.model.llava import LlavaForConditionalGeneration
from runtime.ranks.model.loader import load_model
from runtime.ranks.model.parallel import TPGroup
from tests.support.tp_runs import tp1_and_tp2

pytestmark = pytest.mark.process

PAGE_SIZE = 4
NUM_PAGES = 128
MAX_NEW_TOKENS = 6
IMAGE_TOKEN = 120
VOCAB = 128
KINDS = ("split", "replicated")
FEATURE_ATOL = 1e-5
LOGIT_ATOL = 1e-4


# -- checkpoints ---------------------------------------------------------------------


def _hf_config(kind: str) -> Any:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, Qwen2Config

    text: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        eos_token_id=2,
    )
    vision = dict(image_size=32, patch_size=8, num_hidden_layers=2, projection_dim=32)
    if kind == "split":
        return LlavaConfig(
            vision_config=CLIPVisionConfig(
                hidden_size=64, intermediate_size=128, num_attention_heads=4, **vision
            ),
            text_config=LlamaConfig(**text),
            image_token_index=IMAGE_TOKEN,
        )
    return LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=48, intermediate_size=100, num_attention_heads=3, **vision
        ),
        text_config=Qwen2Config(tie_word_embeddings=True, **text),
        image_token_index=IMAGE_TOKEN,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        projector_hidden_act="gelu_pytorch_tanh",
        multimodal_projector_bias=False,
        tie_word_embeddings=True,
    )


def _hf_model(kind: str) -> Any:
    from transformers import LlavaForConditionalGeneration as HFLlava

    torch.manual_seed(KINDS.index(kind) + 11)
    model = HFLlava(_hf_config(kind)).eval()
    with torch.no_grad():  # unit norms, zero biases and tiny weights would hide mistakes
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + torch.randn_like(param) * 0.1)
            else:
                param.copy_(torch.randn_like(param) * 0.1)
    return model


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab["<image>"] = IMAGE_TOKEN
    del vocab[f"t{IMAGE_TOKEN}"]
    Tokenizer(WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))


def _pixels(count: int, seed: int) -> torch.Tensor:
    """``count`` random images through transformers' CLIPImageProcessor: (count, 3, 32, 32)."""
    from PIL import Image
    from transformers import CLIPImageProcessor

    gen = torch.Generator().manual_seed(seed)
    images = [
        Image.fromarray(
            torch.randint(0, 256, (40, 48, 3), generator=gen, dtype=torch.uint8).numpy()
        )
        for _ in range(count)
    ]
    proc = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return proc(images=images, return_tensors="pt")["pixel_values"].float()


def _prompts(n: int) -> list[tuple[list[int], int]]:
    """(token ids with each image expanded to n image tokens, number of images)."""
    img = [IMAGE_TOKEN] * n
    return [([1, 5, *img, 17, 33], 1), ([1, *img, 9, 40, *img, 41, 3], 2), ([1, 7, 8, 9], 0)]


def _hf_features(hf: Any, pixels: torch.Tensor) -> torch.Tensor:
    out = hf.get_image_features(pixel_values=pixels)
    out = getattr(out, "pooler_output", out)
    return torch.stack(list(out)) if isinstance(out, (list, tuple)) else out


def _hf_references(hf: Any, pixels: torch.Tensor, n: int) -> dict[str, Any]:
    features, greedy, logits = _hf_features(hf, pixels), [], []
    used = 0
    for ids, k in _prompts(n):
        images = {"pixel_values": pixels[used : used + k]} if k else {}
        used += k
        inp = torch.tensor([ids])
        logits.append(hf(input_ids=inp, **images).logits[0])
        out = hf.generate(
            inp,
            attention_mask=torch.ones_like(inp),
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            pad_token_id=0,
            **images,
        )
        greedy.append(out[0, len(ids) :].tolist())
    return {"features": features, "greedy": greedy, "logits": logits}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The checkpoints under one root (each kind a subdirectory), the inputs the
    scenario reads (root/inputs.pt) and transformers' reference outputs."""
    from transformers import CLIPImageProcessor

    root = tmp_path_factory.mktemp("llava")
    pixels = _pixels(3, seed=5)  # prompt 0's image, then prompt 1's two
    refs: dict[str, Any] = {}
    for kind in KINDS:
        hf = _hf_model(kind)
        path = root / kind
        hf.save_pretrained(path)
        CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        ).save_pretrained(path)
        _write_tokenizer(path)
        n = 16 + (kind == "replicated")
        with torch.no_grad():
            refs[kind] = _hf_references(hf, pixels, n)
    torch.save({"pixels": pixels}, root / "inputs.pt")
    return {"root": root, "refs": refs, "pixels": pixels}


# -- the scenario (run by every rank) --------------------------------------------------


class _Pages:
    def __init__(self, seed: int) -> None:
        self.free = list(range(NUM_PAGES))
        random.Random(seed).shuffle(self.free)

    def take(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // PAGE_SIZE)
        taken, self.free = self.free[:n], self.free[n:]
        return taken


Lane = tuple[list[int], int, list[int], list[int]]  # new ids, context after, pages, rows


def _step(
    model: LlavaForConditionalGeneration,
    lanes: Sequence[Lane],
    store: torch.Tensor | None,
    every: bool = False,
) -> list[torch.Tensor]:
    """One packed forward; ``rows`` per new token (-1: its embedding) index ``store``
    (None: the text-only call). Logits of each lane's last token (``every``: all)."""
    meta, positions = AttentionMetadata.build(
        query_lens=[len(ids) for ids, *_ in lanes],
        context_lens=[ctx for _, ctx, *_ in lanes],
        page_tables=[pages for _, _, pages, _ in lanes],
        page_size=PAGE_SIZE,
    )
    ids = torch.tensor([t for lane in lanes for t in lane[0]])  # (N,)
    wanted, start = [], 0
    for lane in lanes:
        q = len(lane[0])
        wanted.append(list(range(start, start + q)) if every else [start + q - 1])
        start += q
    select = torch.tensor([i for w in wanted for i in w])  # (M,)
    if store is None:
        logits = model(ids, positions, meta, select)
    else:
        rows = torch.tensor([r for lane in lanes for r in lane[3]])  # (N,)
        logits = model(ids, positions, meta, select, image_rows=rows, features=store)
    return list(logits.split([len(w) for w in wanted]))


def _rows(ids: Sequence[int], first: int = 0) -> list[int]:
    """Store rows for a prompt's image tokens in order, from ``first``; -1 elsewhere."""
    out, row = [], first
    for t in ids:
        out.append(row if t == IMAGE_TOKEN else -1)
        row += t == IMAGE_TOKEN
    return out


def _greedy(
    model: LlavaForConditionalGeneration, ids: list[int], store: torch.Tensor, pages: _Pages
) -> list[int]:
    eos = set(model.config.eos_token_ids)
    table = pages.take(len(ids) + MAX_NEW_TOKENS)
    (logits,) = _step(model, [(ids, len(ids), table, _rows(ids))], store)
    out = [int(logits[-1].argmax())]
    while len(out) < MAX_NEW_TOKENS and out[-1] not in eos:  # text-only decode steps
        (logits,) = _step(model, [([out[-1]], len(ids) + len(out), table, [-1])], None)
        out.append(int(logits[-1].argmax()))
    return out


def _packed_and_chunked(
    model: LlavaForConditionalGeneration,
    prompts: list[list[int]],
    stores: list[torch.Tensor],
    pages: _Pages,
) -> dict[str, Any]:
    """Prompts 0 and 1 packed in one step over one store (prompt 1's rows after
    prompt 0's), and prompt 1 alone in two chunks split after its first image."""
    a, b = prompts[0], prompts[1]
    store = torch.cat([stores[0], stores[1]])
    lanes = [
        (a, len(a), pages.take(len(a)), _rows(a)),
        (b, len(b), pages.take(len(b)), _rows(b, first=stores[0].shape[0])),
    ]
    packed = _step(model, lanes, store, every=True)
    cut = b.index(IMAGE_TOKEN) + model.image_tokens_per_image
    table = pages.take(len(b))
    rows = _rows(b)
    (first,) = _step(model, [(b[:cut], cut, table, rows[:cut])], stores[1], every=True)
    (second,) = _step(model, [(b[cut:], len(b), table, rows[cut:])], stores[1], every=True)
    return {"packed": packed, "chunked": torch.cat([first, second])}


def run_scenario(root: str, group: TPGroup, rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    pixels = torch.load(Path(root) / "inputs.pt")["pixels"]
    out: dict[str, Any] = {}
    for kind in KINDS:
        model = load_model(Path(root) / kind, group)
        assert isinstance(model, LlavaForConditionalGeneration)
        model.allocate_kv_cache(NUM_PAGES, PAGE_SIZE)
        pages = _Pages(seed=rank + 3)  # ranks need not agree on pages: the KV is per rank
        features = model.encode_images(pixels)  # (3, N, hidden)
        n, hidden = model.image_tokens_per_image, model.config.hidden_size
        stores = [features[:1].reshape(-1, hidden), features[1:].reshape(-1, hidden)]
        stores.append(torch.zeros(1, hidden))  # prompt 2 has no image
        prompts = [ids for ids, _ in _prompts(n)]
        greedy = [_greedy(model, ids, s, pages) for ids, s in zip(prompts, stores)]
        out[kind] = {
            "features": features,
            "greedy": greedy,
            "encoder_split": model.vision_tower.split,
            **_packed_and_chunked(model, prompts, stores, pages),
        }
    return out


@pytest.fixture(scope="module")
def results(checkpoints: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict:
    return tp1_and_tp2(run_scenario, str(checkpoints["root"]), tmp_path_factory.mktemp("tp2"))


# -- equivalence -----------------------------------------------------------------------

CASES = [(kind, tp) for tp in (1, 2) for kind in KINDS]
IDS = [f"{kind}-tp{tp}" for kind, tp in CASES]


@pytest.mark.parametrize(("kind", "tp"), CASES, ids=IDS)
def test_encode_images_matches_transformers(checkpoints, results, kind: str, tp: int) -> None:
    ref = checkpoints["refs"][kind]["features"]
    got = results[tp][kind]["features"]
    assert got.shape == ref.shape == (3, 16 + (kind == "replicated"), 64)
    torch.testing.assert_close(got, ref, atol=FEATURE_ATOL, rtol=0)


@pytest.mark.parametrize(("kind", "tp"), CASES, ids=IDS)
def test_greedy_with_images_matches_generate(checkpoints, results, kind: str, tp: int) -> None:
    assert results[tp][kind]["greedy"] == checkpoints["refs"][kind]["greedy"]


@pytest.mark.parametrize(("kind", "tp"), CASES, ids=IDS)
def test_packed_and_chunked_prefill_match_transformers(
    checkpoints, results, kind: str, tp: int
) -> None:
    ref = checkpoints["refs"][kind]["logits"]
    got = results[tp][kind]
    torch.testing.assert_close(got["packed"][0], ref[0], atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(got["packed"][1], ref[1], atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(got["chunked"], ref[1], atol=LOGIT_ATOL, rtol=0)


def test_encoder_splits_where_its_sizes_allow(results) -> None:
    assert results[1]["split"]["encoder_split"] and results[1]["replicated"]["encoder_split"]
    assert results[2]["split"]["encoder_split"]
    assert not results[2]["replicated"]["encoder_split"]  # 3 heads over 2 ranks


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_ranks_agree(results, kind: str) -> None:
    a, b = results[2][kind], results["rank1"][kind]
    assert torch.equal(a["features"], b["features"])
    assert a["greedy"] == b["greedy"]


# -- the other checkpoint layout -----------------------------------------------------------

# transformers' two LLaVA layouts, each prefix mapped to the other's.
_OTHER_LAYOUT = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.vision_model.", "model.vision_tower."),
    ("vision_tower.", "model.vision_tower.vision_model."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def _other_name(name: str) -> str:
    for old, new in _OTHER_LAYOUT:
        if name.startswith(old):
            return new + name[len(old) :]
    raise AssertionError(f"{name} is in neither layout")


def _copy_dir(src: Path, dst: Path, config: dict[str, Any] | None = None) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_the_other_layout_loads_the_same_model(checkpoints, tmp_path: Path) -> None:
    src = checkpoints["root"] / "split"
    dst = _copy_dir(src, tmp_path / "other")
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {_other_name(k): v for k, v in tensors.items()}
    vision_prefix = next(k for k in renamed if "vision_tower" in k).split("embeddings")[0]
    renamed[vision_prefix + "embeddings.position_ids"] = torch.arange(17).unsqueeze(0)  # old buffer
    assert not set(renamed) & set(tensors)
    save_file(renamed, str(dst / "model.safetensors"))
    a, b = load_model(src), load_model(dst)
    pixels = checkpoints["pixels"]
    assert torch.equal(a.encode_images(pixels), b.encode_images(pixels))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


# -- the directory checks ---------------------------------------------------------------------


def test_check_model_dir_reads_the_vision_half(checkpoints) -> None:
    config = check_model_dir(checkpoints["root"] / "split", tensor_parallel_size=2)
    assert config.accepts_images and config.vision is not None
    assert config.vision.image_token_id == IMAGE_TOKEN
    assert config.vision.image_tokens_per_image == 16
    assert config.architecture == "LlamaForCausalLM" and config.vocab_size == VOCAB
    other = check_model_dir(checkpoints["root"] / "replicated", tensor_parallel_size=2)
    assert other.architecture == "Qwen2ForCausalLM" and other.tie_word_embeddings
    assert other.vision is not None and other.vision.image_tokens_per_image == 17
    assert other.vision.encoder_layers_used == 2 and not other.vision.encoder_splits(2)


def _edit(config: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    config = json.loads(json.dumps(config))
    target, _, key = field.rpartition(".")
    node = config[target] if target else config
    if value is _DELETE:
        del node[key]
    else:
        node[key] = value
    return config


_DELETE = object()
BAD_FIELDS = [
    ("vision_feature_select_strategy", "bogus", "vision_feature_select_strategy"),
    ("vision_config", _DELETE, "vision_config is missing"),
    ("text_config", _DELETE, "text_config is missing"),
    ("vision_feature_layer", [-2, -1], "vision_feature_layer"),
    ("vision_feature_layer", 3, "vision_feature_layer"),
    ("image_token_index", VOCAB, "image_token_index"),
    ("image_token_index", _DELETE, "image_token_index is missing"),
    ("projector_hidden_act", "swish2", "projector_hidden_act"),
    ("multimodal_projector_bias", "yes", "multimodal_projector_bias"),
    ("vision_config.model_type", "siglip_vision_model", "vision_config.model_type"),
    ("vision_config.hidden_size", _DELETE, "vision_config.hidden_size"),
    ("vision_config.patch_size", 7, "vision_config.image_size"),
    ("vision_config.hidden_act", "tanh", "vision_config.hidden_act"),
    ("text_config.hidden_act", "gelu", "text_config: hidden_act"),
]


@pytest.mark.parametrize(("field", "value", "named"), BAD_FIELDS, ids=[f for f, *_ in BAD_FIELDS])
def test_a_bad_field_is_refused_by_name(
    checkpoints, tmp_path: Path, field: str, value: Any, named: str
) -> None:
    src = checkpoints["root"] / "split"
    config = _edit(json.loads((src / "config.json").read_text()), field, value)
    bad = _copy_dir(src, tmp_path / "bad", config)
    with pytest.raises(LoadError, match=named.replace(".", r"\.")) as caught:
        check_model_dir(bad)
    assert isinstance(caught.value, ModelConfigError)  # what the command line catches
    assert "config.json" in str(caught.value)
    with pytest.raises(LoadError, match=named.replace(".", r"\.")):
        load_model(bad)


def test_the_preprocessor_config_is_checked(checkpoints, tmp_path: Path) -> None:
    src = checkpoints["root"] / "split"
    bad = _copy_dir(src, tmp_path / "none")
    (bad / "preprocessor_config.json").unlink()
    with pytest.raises(LoadError, match=r"preprocessor_config\.json"):
        check_model_dir(bad)
    wrong = _copy_dir(src, tmp_path / "crop")
    raw = json.loads((wrong / "preprocessor_config.json").read_text())
    raw["crop_size"] = {"height": 24, "width": 24}
    (wrong / "preprocessor_config.json").write_text(json.dumps(raw))
    with pytest.raises(LoadError, match="crop_size"):
        check_model_dir(wrong)


def test_encode_images_refuses_another_image_size(checkpoints) -> None:
    model = load_model(checkpoints["root"] / "split")
    with pytest.raises(ValueError, match=r"pixels must be \(B, 3, 32, 32\)"):
        model.encode_images(torch.zeros(1, 3, 64, 64))


def test_image_rows_need_features(checkpoints) -> None:
    model = load_model(checkpoints["root"] / "split")
    model.allocate_kv_cache(4, PAGE_SIZE)
    meta, positions = AttentionMetadata.build(
        query_lens=[2], context_lens=[2], page_tables=[[0]], page_size=PAGE_SIZE
    )
    with pytest.raises(ValueError, match="both or neither"):
        model(
            torch.tensor([1, 2]),
            positions,
            meta,
            torch.tensor([1]),
            image_rows=torch.tensor([-1, -1]),
        )


def test_another_vision_language_architecture_is_not_read_as_llava() -> None:
    from runtime.ranks.model.config import ModelConfig
    from runtime.ranks.model.vision_config import VisionConfigError

    raw = {"architectures": ["Qwen2VLForConditionalGeneration"], "vision_config": {}}
    with pytest.raises(ModelConfigError, match="architectures") as caught:
        ModelConfig.from_hf(raw)
    assert not isinstance(caught.value, VisionConfigError)
