"""Image datasets (``multimodal_keys``): every form of image reference in jsonl and parquet rows, the prompt
placeholders and their widened tokens, the limits up front (ConfigError naming file, row and column) and at load
time (the row skipped and counted), and a text model refused before Ray. Real files, real PIL images."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from pathlib import Path

import fsspec
import pytest
from PIL import Image

from raygym import DatasetConfig, ModelConfig, Recipe, TrainConfig
from raygym.builtin.tiny_vlm import (
    IMAGE_PAD,
    IMAGE_PLACEHOLDER,
    VISION_END,
    VISION_START,
    build_image_processor,
    build_vlm_tokenizer,
    image_token_id,
    materialize_vlm,
)
from raygym.data.check import check_prompt_data
from raygym.data.prompts import PromptDataset, dataset_from_config, dataset_options, load_eval_datasets
from raygym.errors import ConfigError
from raygym.run.vision_checks import check_vision_model
from raygym.vision import dataset as vd
from raygym.vision.images import ImageError, decode_image, encode_image, open_image
from raygym.vision.tokens import tokens_per_image

COLORS = [(255, 0, 0), (0, 200, 0), (0, 0, 255), (250, 250, 0), (0, 120, 120), (90, 30, 160)]


@pytest.fixture(scope="module")
def tok():
    return build_vlm_tokenizer()


@pytest.fixture(scope="module")
def proc():
    return build_image_processor()


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    return materialize_vlm(tmp_path_factory.mktemp("vlm"))


def picture(i: int, size=(56, 56)) -> Image.Image:
    image = Image.new("RGB", size, COLORS[i % len(COLORS)])
    image.putpixel((1, 1), (i, 255 - i, 7))  # no two alike
    return image


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def same_pixels(url: str, image: Image.Image) -> bool:
    return decode_image(url).tobytes() == image.convert("RGB").tobytes()


def widened(tok, proc, images) -> int:
    grids = proc(images=list(images))["image_grid_thw"].tolist()
    return sum(tokens_per_image(g, proc.merge_size) for g in grids)


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def png_claiming(width: int, height: int) -> bytes:
    """A small valid PNG whose header says ``width x height`` (a decompression bomb's shape, never decoded)."""
    data = bytearray(png_bytes(Image.new("L", (4, 4))))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4: ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17: ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr: ihdr + 17])) & 0xFFFFFFFF)
    return bytes(data)


# ── every kind of image reference ─────────────────────────────────────────────────────────────────────────────

def test_jsonl_rows_with_every_kind_of_image_reference(tmp_path, tok, proc):
    images = [picture(i, size) for i, size in enumerate([(56, 56), (90, 40), (40, 90), (56, 56), (70, 70), (56, 28)])]
    (tmp_path / "imgs").mkdir()
    images[0].save(tmp_path / "imgs" / "rel.png")
    images[1].save(tmp_path / "abs.png")
    with fsspec.open("memory://vision-data/c.png", "wb") as fh:
        fh.write(png_bytes(images[2]))
    b64 = base64.b64encode(png_bytes(images[4])).decode()
    rows = [
        {"prompt": "relative", "label": "a", "images": "imgs/rel.png"},
        {"prompt": "absolute and url", "label": "b",
         "images": [str(tmp_path / "abs.png"), "memory://vision-data/c.png"]},
        {"prompt": "data url", "label": "c", "images": [encode_image(images[3])]},
        {"prompt": "base64", "label": "d", "images": b64},
        {"prompt": "hf dict", "label": "e", "images": {"bytes": None, "path": "imgs/rel.png"}},
        {"prompt": "text only", "label": "f", "images": None},
    ]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    assert check_prompt_data(path, image_key="images").rows == 6  # every image loads up front
    ds = PromptDataset.from_url(path, tok, image_key="images", image_processor=proc, shuffle=False)
    want = [[images[0]], [images[1], images[2]], [images[3]], [images[4]], [images[0]], []]
    pad = image_token_id(tok)
    for row, expected in zip(ds, want, strict=True):
        assert len(row.images) == len(expected)
        assert all(same_pixels(url, im) for url, im in zip(row.images, expected, strict=True))
        assert all(url.startswith("data:image/png;base64,") for url in row.images)
        n_tokens = widened(tok, proc, expected) if expected else 0
        assert row.prompt_tokens.count(pad) == n_tokens
        assert "images" not in row.columns and row.columns["label"] == row.label
    # the 90x40 image is a 4x6 patch grid: 6 tokens; each 56x56 one 4
    assert ds[1].prompt_tokens.count(pad) == 6 + widened(tok, proc, [images[2]])
    # a text row is tokenized as before
    assert ds[5].prompt_tokens == tok.encode("text only", add_special_tokens=False)


def test_parquet_rows_with_bytes_lists_hf_dicts_and_json_text(tmp_path, tok, proc):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    images = [picture(i) for i in range(4)]
    images[3].save(tmp_path / "side.png")
    # bytes, a list of bytes, an HF image dict, JSON text of a list of relative paths: one file each, as a parquet
    # column has one type
    rows = [
        {"prompt": "bytes", "label": "1", "pics": png_bytes(images[0])},
        {"prompt": "list", "label": "2", "pics": [png_bytes(images[1]), png_bytes(images[2])]},
        {"prompt": "hf", "label": "3", "pics": {"bytes": png_bytes(images[2]), "path": "ignored.png"}},
        {"prompt": "json", "label": "4", "pics": json.dumps(["side.png", "side.png"])},
    ]
    want = [[images[0]], [images[1], images[2]], [images[2]], [images[3], images[3]]]
    pad = image_token_id(tok)
    for i, (row_in, expected) in enumerate(zip(rows, want, strict=True)):
        part = str(tmp_path / f"part{i}.parquet")
        pq.write_table(pa.Table.from_pylist([row_in, {**row_in, "prompt": "again"}]), part)
        assert check_prompt_data(part, image_key="pics").rows == 2
        row, again = PromptDataset.from_url(part, tok, image_key="pics", image_processor=proc, shuffle=False)
        assert [same_pixels(u, im) for u, im in zip(row.images, expected, strict=True)] == [True] * len(expected)
        assert row.prompt_tokens.count(pad) == widened(tok, proc, expected)
        assert row.prompt_tokens[:1] == [tok.convert_tokens_to_ids(VISION_START)]  # placeholders put in front
        assert set(row.columns) == {"label"} and again.images == row.images


def test_memory_data_file_with_relative_image_paths(tok, proc):
    image = picture(5, (90, 40))
    with fsspec.open("memory://vision-mem/set/img/x.png", "wb") as fh:
        fh.write(png_bytes(image))
    with fsspec.open("memory://vision-mem/set/rows.jsonl", "wt") as fh:
        fh.write(json.dumps({"prompt": "q", "label": "l", "images": ["img/x.png"]}) + "\n")
    (row,) = PromptDataset.from_url("memory://vision-mem/set/rows.jsonl", tok, image_key="images",
                                    image_processor=proc)
    assert same_pixels(row.images[0], image)
    assert row.prompt_tokens.count(image_token_id(tok)) == 6


# ── placeholders, chat parts, tokens ──────────────────────────────────────────────────────────────────────────

def test_placeholders_prepended_kept_in_place_or_refused(tok, proc, tmp_path):
    a, b = picture(0), picture(1, (90, 40))
    urls = [encode_image(a), encode_image(b)]
    rows = [{"prompt": "ab", "label": "", "images": urls},
            {"prompt": f"x{IMAGE_PLACEHOLDER}y{IMAGE_PLACEHOLDER}z", "label": "", "images": urls}]
    ds = PromptDataset(rows, tok, image_key="images", image_processor=proc, shuffle=False)
    start, pad, end = (tok.convert_tokens_to_ids(t) for t in (VISION_START, IMAGE_PAD, VISION_END))
    x, y, z, ab = (tok.encode(t, add_special_tokens=False) for t in ("x", "y", "z", "ab"))
    assert ds[0].prompt_tokens == [start, *[pad] * 4, end, start, *[pad] * 6, end, *ab]
    assert ds[1].prompt_tokens == [*x, start, *[pad] * 4, end, *y, start, *[pad] * 6, end, *z]
    bad = [{"prompt": "fine", "label": "", "images": urls[:1]},
           {"prompt": f"{IMAGE_PLACEHOLDER} only one", "label": "", "images": urls}]
    with pytest.raises(ConfigError, match=r"row 1: the prompt has 1 image placeholder\(s\) but the row has 2"):
        PromptDataset(bad, tok, image_key="images", image_processor=proc)
    path = write_jsonl(tmp_path / "rows.jsonl", bad)
    with pytest.raises(ConfigError, match=r"rows.jsonl' line 2 \(row 1\): the prompt has 1 image placeholder"):
        check_prompt_data(path, image_key="images")
    text_with_placeholder = [{"prompt": f"{IMAGE_PLACEHOLDER}?", "label": "", "images": []}]
    with pytest.raises(ConfigError, match="row 0: the prompt has 1 image placeholder"):
        PromptDataset(text_with_placeholder, tok, image_key="images", image_processor=proc)


def test_chat_parts_become_placeholders_where_the_images_are(tok, proc):
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"},
                                             {"type": "text", "text": "and"},
                                             {"type": "image_url", "image_url": {"url": "ignored"}}]}]
    image = [picture(2), picture(3)]
    rows = [{"prompt": messages, "label": "", "images": [encode_image(im) for im in image]},
            {"prompt": [{"role": "user", "content": "plain"}], "label": "", "images": [encode_image(image[0])]}]
    ds = PromptDataset(rows, tok, image_key="images", image_processor=proc, apply_chat_template=True, shuffle=False)
    start, pad, end = (tok.convert_tokens_to_ids(t) for t in (VISION_START, IMAGE_PAD, VISION_END))
    enc = tok.encode
    image_tokens = [start, *[pad] * 4, end]
    assert ds[0].prompt_tokens == [*enc("slook"), *image_tokens, *enc("and"), *image_tokens]
    assert ds[0].prompt == messages  # the raw prompt is kept
    assert ds[1].prompt_tokens == [*image_tokens, *enc("plain")]  # in front of the user's message
    assert vd.count_placeholders(messages) == 2
    with pytest.raises(ConfigError, match="neither text nor an image"):
        vd.flatten_image_parts([{"role": "user", "content": [{"type": "audio"}]}], "row 3")


def test_truncation_never_cuts_an_image_and_filter_counts_the_widened_length(tok, proc):
    url = encode_image(picture(0))  # 4 image tokens
    rows = [{"prompt": "abcdef", "label": "", "images": [url]},  # S PPPP E abcdef: 12 tokens
            {"prompt": "abcdefghij", "label": "", "images": []}]
    keep = PromptDataset(rows, tok, image_key="images", image_processor=proc, shuffle=False, max_prompt_len=12,
                         prompt_len_policy="truncate")
    assert len(keep[0].prompt_tokens) == 12 and keep[0].images == [url]
    cut = PromptDataset(rows, tok, image_key="images", image_processor=proc, shuffle=False, max_prompt_len=8,
                        prompt_len_policy="truncate")
    assert (len(cut), cut.num_image_cuts) == (1, 1) and cut[0].prompt_tokens == tok.encode("cdefghij")
    whole = PromptDataset(rows, tok, image_key="images", image_processor=proc, shuffle=False, max_prompt_len=6,
                          prompt_len_policy="truncate")
    assert whole[0].prompt_tokens == tok.encode("abcdef") and whole[0].images == []  # the image cut off whole
    filtered = PromptDataset(rows, tok, image_key="images", image_processor=proc, shuffle=False, max_prompt_len=11)
    assert (len(filtered), filtered.num_filtered) == (1, 1) and filtered[0].images == []


# ── limits: up front a ConfigError, at load time a skipped row ────────────────────────────────────────────────

def test_limits_and_bad_images_up_front_name_file_line_and_column(tmp_path):
    good = encode_image(picture(0))
    (tmp_path / "big.png").write_bytes(b"\0" * (vd.MAX_IMAGE_BYTES + 1))
    (tmp_path / "broken.png").write_bytes(b"not an image at all")
    cases = [
        ([good] * (vd.MAX_IMAGES_PER_SAMPLE + 1), r"9 images, more than the 8 a sample may have"),
        (["big.png"], r"image 0: .*big.png.*: 20971521 bytes is more than the 20971520 bytes"),
        ([good, "broken.png"], r"image 1: .*broken.png.*not a readable image"),
        (["missing.png"], r"image 0: .*missing.png.*no file at that path"),
        ([base64.b64encode(png_claiming(8000, 6000)).decode()], r"8000x6000 pixels .* more than the 40000000"),
        ([base64.b64encode(png_claiming(30000, 30000)).decode()], r"too many pixels to decode"),
        ([12], r"image 0: 12: an image is a path, URL, base64 text or bytes, not int"),
        (12, r"holds a int"),
    ]
    for images, pattern in cases:
        path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "p", "label": "", "images": [good]},
                                                      {"prompt": "p", "label": "", "images": images}])
        with pytest.raises(ConfigError, match=r"prompt_data=.*rows.jsonl' line 2 \(row 1\): multimodal_keys column "
                                              rf"'images'.*{pattern}"):
            check_prompt_data(path, image_key="images")
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "p", "label": ""}])
    with pytest.raises(ConfigError, match=r"line 1 \(row 0\): no column 'images' for the images of multimodal_keys"):
        check_prompt_data(path, image_key="images")


def test_parquet_bad_bytes_up_front_names_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"prompt": "p", "label": "", "pics": png_bytes(picture(0))},
            {"prompt": "p", "label": "", "pics": b"garbage"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    with pytest.raises(ConfigError, match=r"rows.parquet' row 1: multimodal_keys column 'pics', image 0: .*"
                                          r"not a readable image"):
        check_prompt_data(str(tmp_path / "rows.parquet"), image_key="pics")
    with pytest.raises(ConfigError, match=r"no column 'images'"):
        check_prompt_data(str(tmp_path / "rows.parquet"), image_key="images")


def test_rows_whose_images_fail_at_load_time_are_skipped_and_counted(tok, proc):
    good = picture(0)
    with fsspec.open("memory://vision-remote/ok.png", "wb") as fh:
        fh.write(png_bytes(good))
    rows = [{"prompt": "a", "label": "", "images": ["memory://vision-remote/ok.png"]},
            {"prompt": "b", "label": "", "images": ["memory://vision-remote/gone.png"]},  # a URL that is down
            {"prompt": "c", "label": "", "images": [encode_image(good)] * 9},
            {"prompt": "d", "label": "", "images": [base64.b64encode(png_claiming(9000, 9000)).decode()]},
            {"prompt": "e", "label": "", "images": [encode_image(good)]}]
    with fsspec.open("memory://vision-remote/rows.jsonl", "wt") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows))
    # a remote file's images are not read up front, only its structure is checked (here: too many images)
    with pytest.raises(ConfigError, match=r"line 3 \(row 2\): multimodal_keys column 'images': 9 images"):
        check_prompt_data("memory://vision-remote/rows.jsonl", image_key="images")
    ds = PromptDataset.from_url("memory://vision-remote/rows.jsonl", tok, image_key="images", image_processor=proc,
                                shuffle=False)
    assert [r.prompt for r in ds] == ["a", "e"] and ds.num_bad_images == 3
    assert len(ds.bad_image_reasons) == 3
    assert "row 1: multimodal_keys column 'images', image 0: 'memory://vision-remote/gone.png'" in ds.bad_image_reasons[0]
    assert "9 images" in ds.bad_image_reasons[1] and "9000x9000" in ds.bad_image_reasons[2]
    with pytest.raises(ConfigError, match=r"no usable rows .* 1 with unusable images.*first image problem"):
        PromptDataset(rows[1:2], tok, image_key="images", image_processor=proc)


def test_open_image_turns_pil_bomb_guard_into_image_error():
    with pytest.raises(ImageError, match="too many pixels to decode"):
        open_image(png_claiming(40000, 40000), "bomb.png")
    with pytest.raises(ImageError, match="not a readable image"):
        open_image(b"\x89PNG\r\n\x1a\n" + b"\0" * 30, "cut.png")


# ── the field, the model, the config ──────────────────────────────────────────────────────────────────────────

@pytest.mark.parametrize(("value", "pattern"), [
    ({"video": "clips"}, r"multimodal_keys=\{'video': 'clips'\}: modality 'video' is not supported"),
    ('{"image": "pics", "audio": "a"}', r"modality 'audio' is not supported .* map only \"image\""),
    ({"image": 3}, r"the column of 'image' must be a column name \(text\), not 3"),
    ({"image": ""}, r"must be a column name"),
    ("[1, 2]", r"must be a JSON object mapping a modality"),
    ("{oops", r"not valid JSON"),
])
def test_parse_multimodal_keys_errors(value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        vd.parse_multimodal_keys(value)
    with pytest.raises(ConfigError, match="multimodal_keys="):
        Recipe(multimodal_keys=value)


def test_multimodal_keys_is_accepted_by_the_recipe_and_the_cli():
    from raygym.config.constants import UNSUPPORTED_RECIPE_FIELDS
    from raygym.run.config_loading import load_train_config

    assert "multimodal_keys" not in UNSUPPORTED_RECIPE_FIELDS
    assert vd.parse_multimodal_keys(None) == vd.parse_multimodal_keys("") == vd.parse_multimodal_keys({}) == {}
    assert vd.image_column(Recipe(multimodal_keys='{"image": "pics"}').multimodal_keys) == "pics"
    cfg = load_train_config(["--preset", "tiny", "--multimodal-keys", '{"image": "pics"}'])
    assert vd.image_column(cfg.recipe.multimodal_keys) == "pics"
    with pytest.raises(ConfigError, match="modality 'video'"):
        load_train_config(["--preset", "tiny", "--multimodal-keys", '{"video": "v"}'])


def test_a_text_model_with_multimodal_keys_is_refused(tmp_path, vlm_path, proc):
    keys = {"image": "images"}
    with pytest.raises(ConfigError, match=r"needs a vision-language checkpoint .* hf_checkpoint='builtin:tiny-qwen3' "
                                          r"is a text-only model"):
        check_vision_model(keys, "builtin:tiny-qwen3")
    text_dir = tmp_path / "text-model"
    text_dir.mkdir()
    (text_dir / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ConfigError, match="needs a vision-language checkpoint"):
        check_vision_model(keys, str(text_dir))
    with pytest.raises(ConfigError, match="needs a vision-language checkpoint"):
        vd.load_image_processor(str(text_dir))
    check_vision_model(keys, vlm_path)
    check_vision_model(keys, "builtin:tiny-qwen2.5-vl")
    check_vision_model(keys, "some-org/not-downloaded-model")  # not checkable without a download: passes here
    check_vision_model(None, "builtin:tiny-qwen3")
    from raygym.builtin import build_tokenizer

    with pytest.raises(ConfigError, match=r"the tokenizer has no <\|image_pad\|> token"):
        PromptDataset([{"prompt": "p", "label": "", "images": []}], build_tokenizer(), image_key="images",
                      image_processor=proc)


def vision_config(tmp_path: Path, model: str, prompt_data: str, **recipe) -> TrainConfig:
    from raygym.presets import tiny

    return TrainConfig(
        recipe=tiny().replace(rm_type="exact", multimodal_keys={"image": "images"}, rollout_engine="raygym",
                              trainer_backend="torch", **recipe),
        model=ModelConfig(hf_checkpoint=model), dataset=DatasetConfig(prompt_data=prompt_data),
        output_dir=str(tmp_path / "run"))


def test_preflight_checks_images_and_model_and_the_config_loads_the_processor(tmp_path, vlm_path):
    from transformers import AutoTokenizer

    from raygym.run.preflight import preflight

    images = [picture(0), picture(1, (90, 40))]
    for i, im in enumerate(images):
        im.save(tmp_path / f"{i}.png")
    rows = [{"prompt": "a", "label": "x", "images": ["0.png"], "extra": 1},
            {"prompt": "b", "label": "y", "images": ["0.png", "1.png"], "extra": 2}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    facts = preflight(vision_config(tmp_path, vlm_path, path))
    assert facts.data.rows == 2
    with pytest.raises(ConfigError, match="needs a vision-language checkpoint"):
        preflight(vision_config(tmp_path, "builtin:tiny-qwen3", path))
    broken = write_jsonl(tmp_path / "broken.jsonl", [*rows, {"prompt": "c", "label": "z", "images": "nope.png"}])
    with pytest.raises(ConfigError, match=r"prompt_data=.*broken.jsonl' line 3 \(row 2\): multimodal_keys column "
                                          r"'images', image 0: .*nope.png.*no file"):
        preflight(vision_config(tmp_path, vlm_path, broken))

    cfg = vision_config(tmp_path, vlm_path, path)
    options = dataset_options(cfg)
    assert (options["image_key"], options["image_processor"]) == ("images", vlm_path)
    tokenizer = AutoTokenizer.from_pretrained(vlm_path)
    ds = dataset_from_config(cfg, tokenizer)
    proc = vd.load_image_processor(vlm_path)
    assert [len(r.images) for r in ds] in ([1, 2], [2, 1])
    for row in ds:
        expected = [images[0]] if len(row.images) == 1 else images
        assert row.prompt_tokens.count(image_token_id(tokenizer)) == widened(tokenizer, proc, expected)
        assert set(row.columns) == {"label", "extra"}
    evals = load_eval_datasets({"dev": path}, tokenizer, **{k: v for k, v in options.items() if k != "shuffle"})
    assert [len(r.images) for r in evals["dev"]] == [1, 2]


def test_text_datasets_are_unchanged_without_multimodal_keys(tmp_path):
    from raygym.builtin import build_tokenizer
    from raygym.presets import tiny

    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "2+2=", "label": "4", "images": "x.png"}])
    cfg = TrainConfig(recipe=tiny(), model=ModelConfig(hf_checkpoint="builtin:tiny-qwen3"),
                      dataset=DatasetConfig(prompt_data=path))
    assert (dataset_options(cfg)["image_key"], dataset_options(cfg)["image_processor"]) == (None, None)
    (row,) = dataset_from_config(cfg, build_tokenizer())
    assert row.images == [] and row.columns == {"label": "4", "images": "x.png"}
    assert row.prompt_tokens == build_tokenizer().encode("2+2=", add_special_tokens=False)
    assert row._replace(label="5").images == [] and row._replace(images=["u"]).columns == row.columns
