"""Qwen3.5 with images (issue 60's model, in process): the vision tower equals transformers' ``Qwen3_5VisionModel``,
multimodal RoPE positions equal ``get_rope_index``'s for a mixed batch, and the whole model's logits equal
``Qwen3_5ForConditionalGeneration``'s for text-only and image+text input (random init, fp32, tiny shapes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModel, Qwen3_5Config, Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig

from tests.support.qwen3_5 import VOCAB, tiny_qwen3_5
from torchtitan.models.qwen3_5.hf_adapter import QWEN3_5
from torchtitan.models.qwen3_5.multimodal import Qwen35VL, Qwen35VLArgs, mrope_positions
from torchtitan.models.qwen3_5.vision import VisionArgs, VisionTower

VISION = VisionArgs(depth=2, dim=64, ffn_dim=96, n_heads=4, patch_size=4, out_dim=64, num_position_embeddings=64)
IMAGE, START, END = VOCAB - 3, VOCAB - 2, VOCAB - 1  # the tiny vocabulary's last ids stand for the special tokens
GRIDS = [(1, 6, 8), (1, 4, 4), (2, 4, 6)]  # (frames, patch rows, patch columns): 12, 4 and 12 image tokens


def _vision_config() -> Qwen3_5VisionConfig:
    v = VISION
    return Qwen3_5VisionConfig(
        depth=v.depth,
        hidden_size=v.dim,
        intermediate_size=v.ffn_dim,
        num_heads=v.n_heads,
        patch_size=v.patch_size,
        out_hidden_size=v.out_dim,
        num_position_embeddings=v.num_position_embeddings,
    )


def _tower(seed: int = 0) -> VisionTower:
    torch.manual_seed(seed)
    tower = VisionTower(VISION)
    tower.init_weights()
    with torch.no_grad():  # off the init's zero biases and unit norms
        for p in tower.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return tower.eval()


def _pixels(grids) -> torch.Tensor:
    patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(patches, VISION.patch_values, generator=torch.Generator().manual_seed(3))


def test_tower_equals_transformers():
    """Learned positions resampled to each grid (bilinear), 2D rotary attention within each frame, the 2x2 merger:
    three images of different grids, one of two frames."""
    ours = _tower()
    theirs = AutoModel.from_config(_vision_config()).eval()
    theirs.load_state_dict(ours.state_dict())
    pixels = _pixels(GRIDS)
    with torch.no_grad():
        got, want = ours(pixels, GRIDS), theirs(pixels, grid_thw=torch.tensor(GRIDS)).pooler_output
    assert got.shape == (28, VISION.out_dim)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


def _row(pieces: list) -> list[int]:
    """Text ids and images (an int: that many image tokens, between vision_start and vision_end)."""
    out = []
    for piece in pieces:
        out += [START, *[IMAGE] * piece, END] if isinstance(piece, int) else piece
    return out


ROWS = [  # two rows of 40: images at the start, in the middle, back to back
    _row([[5, 6, 7], 12, [8, 9], 4, list(range(10, 25))]),
    _row([12, list(range(30, 56))]),
]


def _model() -> tuple[Qwen35VL, Qwen3_5ForConditionalGeneration]:
    text, fields = tiny_qwen3_5()
    shared = {f.name: getattr(text.args, f.name) for f in dataclasses.fields(text.args)}
    args = Qwen35VLArgs(**shared, vision=VISION, image_token_id=IMAGE, vision_start_token_id=START)
    ours = Qwen35VL(dataclasses.replace(args, vision_end_token_id=END)).eval()
    ours.load_state_dict(text.state_dict() | {f"visual.{k}": w for k, w in _tower().state_dict().items()})
    text_config = QWEN3_5.hf_config(fields, {}, torch.float32)
    config = Qwen3_5Config(
        text_config=text_config,
        vision_config=_vision_config(),
        image_token_id=IMAGE,
        vision_start_token_id=START,
        vision_end_token_id=END,
        tie_word_embeddings=fields["tie_word_embeddings"],
    )
    theirs = Qwen3_5ForConditionalGeneration(config).eval()
    hf = {
        k.replace("model.", "model.language_model.", 1): w
        for k, w in QWEN3_5.to_hf_state_dict(text.state_dict(), fields).items()
    }
    hf |= {f"model.visual.{k}": w for k, w in ours.visual.state_dict().items() if k != "inv_freq"}
    theirs.load_state_dict(hf)
    return ours, theirs


def test_mrope_positions_equal_transformers():
    """Two rows with images placed differently: our (3, bs, seqlen) positions are get_rope_index's."""
    _, theirs = _model()
    tokens = torch.tensor(ROWS)
    grids = [GRIDS[0], GRIDS[1], GRIDS[2]]
    want, _ = theirs.model.get_rope_index(tokens, (tokens == IMAGE).int(), image_grid_thw=torch.tensor(grids))
    assert torch.equal(mrope_positions(tokens, grids, IMAGE, 2), want)


@pytest.mark.parametrize("images", [False, True], ids=["text_only", "image_and_text"])
def test_logits_equal_transformers(images):
    ours, theirs = _model()
    if images:
        tokens, grids = torch.tensor(ROWS), GRIDS
        pixels = _pixels(grids)
        theirs_in = dict(
            pixel_values=pixels, image_grid_thw=torch.tensor(grids), mm_token_type_ids=(tokens == IMAGE).int()
        )
        ours_in = dict(pixel_values=pixels, grid_thw=grids)
    else:
        tokens = torch.randint(0, IMAGE, (2, 40), generator=torch.Generator().manual_seed(4))
        theirs_in, ours_in = {}, {}
    with torch.no_grad():
        got, want = ours(tokens, **ours_in), theirs(input_ids=tokens, **theirs_in).logits
    gap = ((got - want).abs().max() / want.abs().max()).item()
    assert gap <= 1e-5, gap
    if images:  # the images matter: without their features the image rows' logits move
        with torch.no_grad():
            blind = ours(tokens, positions=mrope_positions(tokens, grids, IMAGE, 2))
        assert (blind - got).abs().max() > 1e-3


def test_mismatched_images_are_one_line():
    """Images in another order than the text's runs, patches that are not the grids', fewer images than runs."""
    ours, _ = _model()
    tokens = torch.tensor(ROWS)
    swapped = [GRIDS[1], GRIDS[0], GRIDS[2]]
    cases = [
        (
            dict(pixel_values=_pixels(swapped), grid_thw=swapped),
            r"gives 4 tokens \(merge 2\), but its run in the text has 12",
        ),
        (dict(pixel_values=_pixels(GRIDS)[:-1], grid_thw=GRIDS), "pixel_values has 111 patch rows"),
        (
            dict(pixel_values=_pixels(GRIDS[:2]), grid_thw=GRIDS[:2]),
            "the text has 28 image tokens and its images give 16",
        ),
    ]
    for inputs, expected in cases:
        with pytest.raises(ValueError, match=expected) as info:
            ours(tokens, **inputs)
        assert "\n" not in str(info.value)


def test_the_multimodal_folder_round_trips_and_loads_in_transformers(tmp_path):
    """Our weights -> a Hugging Face folder (config.json with text_config and vision_config) that transformers loads
    as Qwen3_5ForConditionalGeneration with our logits on image+text; back, bit for bit, with the same args."""
    from torchtitan.checkpointing.hf.files import save_hf_folder
    from torchtitan.models.qwen3_5.hf_vl_adapter import QWEN3_5_VL

    ours, _ = _model()
    args = dataclasses.asdict(ours.args)
    weights = {k: v for k, v in ours.state_dict().items() if not k.endswith("inv_freq")}
    hf = QWEN3_5_VL.to_hf_state_dict(weights, args)
    config = QWEN3_5_VL.hf_config(args, hf, torch.float32)
    save_hf_folder(hf, config, str(tmp_path))
    theirs = Qwen3_5ForConditionalGeneration.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens, pixels = torch.tensor(ROWS), _pixels(GRIDS)
    with torch.no_grad():
        got = ours(tokens, pixel_values=pixels, grid_thw=GRIDS)
        want = theirs(
            input_ids=tokens,
            pixel_values=pixels,
            image_grid_thw=torch.tensor(GRIDS),
            mm_token_type_ids=(tokens == IMAGE).int(),
        ).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    back = QWEN3_5_VL.from_hf_state_dict(hf, args)
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)
    read = QWEN3_5_VL.model_args_from_hf(config)
    assert read["vision"] == args["vision"] and all(read[k] == args[k] for k in read if k != "vision")


def test_greedy_generation_with_an_image_equals_transformers():
    """A prompt with an image (the middle of the text), greedy: ours with the KV cache (the prompt's multimodal
    positions, then text from its last position on) equals transformers' generate, and ours without the cache. The
    matrices are drawn at unit gain so the mixers pick the tokens; another image changes the text (the image is
    read)."""
    from torchtitan.components.generation import KVCache, generate
    from torchtitan.models.qwen3_5.multimodal import ImagePrompt

    ours, theirs = _model()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if p.dim() >= 2 and "embeddings" not in name and "visual" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        theirs.load_state_dict(
            {
                k.replace("model.", "model.language_model.", 1): w
                for k, w in QWEN3_5.to_hf_state_dict(
                    {k: v for k, v in ours.state_dict().items() if not k.startswith("visual.")}, _fields(ours)
                ).items()
            }
            | {f"model.visual.{k}": w for k, w in ours.visual.state_dict().items() if k != "inv_freq"}
        )
    prompt = torch.tensor([_row([[5, 6, 7], 12, [8, 9, 10]])])
    grids, pixels = [GRIDS[0]], _pixels([GRIDS[0]])
    got = generate(ImagePrompt(ours, pixels, grids), prompt, 16, use_cache=True)
    want = theirs.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        pixel_values=pixels,
        image_grid_thw=torch.tensor(grids),
        mm_token_type_ids=(prompt == IMAGE).int(),
        max_new_tokens=16,
        do_sample=False,
    )
    assert torch.equal(got, want), (got[0, prompt.shape[1] :].tolist(), want[0, prompt.shape[1] :].tolist())
    assert torch.equal(got, generate(ImagePrompt(ours, pixels, grids), prompt, 16, use_cache=False))
    other = generate(ImagePrompt(ours, pixels.flip(0), grids), prompt, 16, use_cache=True)
    assert not torch.equal(got, other)
    # the cached step's logits equal a full forward's, and continuing from the prompt's last multimodal position
    # (not from its length) is what makes them equal
    with torch.no_grad():
        want_logits = ours(got, pixel_values=pixels, grid_thw=grids)[0, -1]
        for shift, close in ((None, True), (0, False)):
            bound = ImagePrompt(ours, pixels, grids)
            cache = KVCache(got.shape[1])
            swapped = cache.install(bound)
            bound(got[:, :-1], torch.arange(got.shape[1] - 1))
            cache.length = got.shape[1] - 1
            bound.shift = bound.shift if shift is None else shift
            logits = bound(got[:, -1:], torch.arange(got.shape[1] - 1, got.shape[1]))[0, -1]
            KVCache.uninstall(swapped)
            gap = ((logits - want_logits).abs().max() / want_logits.abs().max()).item()
            assert (gap <= 1e-5) if close else (gap > 1e-2), (shift, gap)


def _fields(model: Qwen35VL) -> dict:
    return {k: v for k, v in dataclasses.asdict(model.args).items() if k not in ("vision",)}


@pytest.mark.parametrize("flavor", ["9B", "27B"])
def test_published_image_flavors_have_transformers_parameter_count(flavor):
    """qwen3_5_vl's published flavors (the text model and the 9B/27B vision_config) built on the meta device have as
    many parameters as transformers' Qwen3_5ForConditionalGeneration of the config our adapter writes."""
    from torchtitan.models.qwen3_5.hf_vl_adapter import QWEN3_5_VL
    from torchtitan.spec import get_model_spec

    args = get_model_spec("qwen3_5_vl").flavors[flavor]
    with torch.device("meta"):
        ours = Qwen35VL(dataclasses.replace(args, max_seq_len=16))
        config = QWEN3_5_VL.hf_config(dataclasses.asdict(args), {}, torch.float32)
        theirs = Qwen3_5ForConditionalGeneration(
            Qwen3_5Config(
                text_config=config["text_config"],
                vision_config=Qwen3_5VisionConfig(**config["vision_config"]),
                **{k: config[k] for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id")},
                tie_word_embeddings=config["tie_word_embeddings"],
            )
        )
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()), flavor


def test_a_multimodal_folder_maps_to_the_image_family():
    """model_type "qwen3_5" (the published folders) is read whole by qwen3_5_vl; the text family still imports such a
    folder's language model when named (hf_wrapper_model_type)."""
    from torchtitan.spec import get_model_spec, spec_for_hf_model_type

    assert spec_for_hf_model_type("qwen3_5").name == "qwen3_5_vl"
    assert spec_for_hf_model_type("qwen3_5_moe").name == "qwen3_5_moe_vl"
    assert spec_for_hf_model_type("qwen3_5_text").name == "qwen3_5"
    assert get_model_spec("qwen3_5").reads_hf_model_type("qwen3_5")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--model.name", "qwen3_5_vl", "--training.dataset_format", "chat", "--model.attn_mask_type", "causal"],
            "needs model.attn_mask_type = 'block_causal' and model.positions_per_document = true",
        ),
        (["--model.name", "llama3", "--model.freeze_vision"], "model.freeze_vision = true with model.name = 'llama3'"),
    ],
)
def test_image_settings_are_checked_before_launch(flags, expected):
    from torchtitan.config.manager import JobConfig
    from torchtitan.preflight import run_preflight

    argv = ["--model.flavor", "debugmodel", "--model.tokenizer_path", "./tests/assets/sft/tokenizer", *flags]
    config = JobConfig.parse_args(argv)
    with pytest.raises((ValueError, NotImplementedError)) as info:
        run_preflight(config, 1, this_machine=False)
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_mfu_counts_the_towers_flops_from_its_weights():
    """MFU's image term equals 6 per weight (the patch embedding's and blocks' per patch, the merger's per merged
    token) and 12 per attention pair and width, counted from the tower's own weight matrices."""
    from torchtitan.spec import get_model_spec

    args = get_model_spec("qwen3_5_vl").flavors["debugmodel"]
    tower = Qwen35VL(args).visual
    per_patch = tower.patch_embed.proj.weight.numel() + sum(
        m.weight.numel() for m in tower.blocks.modules() if isinstance(m, torch.nn.Linear)
    )
    merger = sum(m.weight.numel() for m in tower.merger.modules() if isinstance(m, torch.nn.Linear))
    patches, pairs = 4 * 36, 4 * 36**2  # four 6x6-patch images
    want = 6 * per_patch * patches + 6 * merger * patches / 4 + 12 * args.vision.depth * args.vision.dim * pairs
    assert args.image_flops(patches, pairs) == want


def test_compiled_tower_equals_eager_over_other_images_without_recompiling():
    """training.compile's tower (distributed/parallelize.py ``compile_tower_blocks``): each block's steps before and
    after its per-frame attention compiled, the patches' count dynamic. Batches of other images (4, 4, 1 and 1
    frames; 32 to 112 patches): outputs and the weights' gradients equal eager's (fp32, 1e-5), and every batch after
    the first reuses its graphs (a block that took the frame lengths into its graph recompiled at every step)."""
    from torch._dynamo.utils import counters

    from torchtitan.distributed.parallelize import compile_tower_blocks

    eager, compiled = _tower(), _tower()
    compile_tower_blocks(compiled)
    torch._dynamo.reset()
    counters.clear()
    batches = [GRIDS, [(1, 4, 4), (1, 4, 8), (2, 6, 4)], [(1, 6, 8)], [(1, 4, 8)]]
    graphs = []
    for grids in batches:
        pixels = _pixels(grids)
        for model in (eager, compiled):
            model.zero_grad()
            model(pixels, grids).square().mean().backward()
        assert torch.allclose(compiled(pixels, grids), eager(pixels, grids), rtol=1e-5, atol=1e-6)
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name
        graphs.append(int(counters["stats"]["unique_graphs"]))
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * 3, graphs
