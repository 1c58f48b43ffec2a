"""Qwen3.5 with images (issue 60's model, in process): the vision tower equals transformers' ``Qwen3_5VisionModel``,
multimodal RoPE positions equal ``get_rope_index``'s for a mixed batch, and the whole model's logits equal
``Qwen3_5ForConditionalGeneration``'s for text-only and image+text input (random init, fp32, tiny shapes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModel, Qwen3_5Config, Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig

from tests.unit.test_qwen3_5 import VOCAB, _built
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
    text, fields = _built()
    args = Qwen35VLArgs(text=text.args, vision=VISION, image_token_id=IMAGE, vision_start_token_id=START)
    ours = Qwen35VL(dataclasses.replace(args, vision_end_token_id=END)).eval()
    ours.language_model.load_state_dict(text.state_dict())
    ours.visual.load_state_dict(_tower().state_dict())
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
        for k, w in QWEN3_5.to_hf_state_dict(ours.language_model.state_dict(), fields).items()
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
    """Images in another order than the text's runs, patches that are not the grids', pads without images."""
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
    cases.append(({}, "a run of 12 image tokens has no image left in grid_thw"))
    for inputs, expected in cases:
        with pytest.raises(ValueError, match=expected) as info:
            ours(tokens, **inputs)
        assert "\n" not in str(info.value)


def test_the_multimodal_folder_round_trips_and_loads_in_transformers(tmp_path):
    """Our weights -> a Hugging Face folder (config.json with text_config and vision_config) that transformers loads
    as Qwen3_5ForConditionalGeneration with our logits on image+text; back, bit for bit, with the same args."""
    from torchtitan.checkpointing.hf_files import save_hf_folder
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
    assert read["vision"] == {k: v for k, v in args["vision"].items()} and read["text"] == {
        k: args["text"][k] for k in read["text"]
    }
