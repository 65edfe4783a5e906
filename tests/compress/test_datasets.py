"""Dataset specs, loading, the EOS token-stream convention and calibration windows."""

from __future__ import annotations

import json
import time

import pytest
import torch

from slimserve.compress import datasets as ds
from slimserve.compress.datasets import (
    DatasetError,
    DatasetSpec,
    calibration_batches,
    encode_documents,
    load_texts,
    parse_dataset,
)
from slimserve.runtime import corpus


class ByteTokenizer:
    """Minimal HF-shaped tokenizer: one id per UTF-8 byte, EOS = 256."""

    def __init__(self, eos_token_id: int | None = 256):
        self.eos_token_id = eos_token_id

    def __call__(self, texts, add_special_tokens=True):
        assert add_special_tokens is False
        return {"input_ids": [list(t.encode("utf-8")) for t in texts]}


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_text_file_is_one_document(tmp_path):
    f = write(tmp_path / "a.txt", "héllo\nworld\n")
    spec = parse_dataset(f"text:{f}")
    assert spec == DatasetSpec("text", path=f.resolve())
    assert load_texts(spec) == ["héllo\nworld\n"]
    assert load_texts(f"text:{f}") == ["héllo\nworld\n"]


def test_text_missing_file_names_path(tmp_path):
    with pytest.raises(DatasetError, match="nope.txt"):
        parse_dataset(f"text:{tmp_path / 'nope.txt'}")


def test_text_not_utf8(tmp_path):
    f = tmp_path / "bin.txt"
    f.write_bytes(b"ok\xff\xfe")
    with pytest.raises(DatasetError, match="not UTF-8 at byte 2"):
        load_texts(f"text:{f}")


def test_relative_paths_resolve_against_base_dir(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    write(tmp_path / "data" / "c.txt", "x")
    monkeypatch.chdir(tmp_path / "data")  # cwd must not matter when base_dir is given
    spec = parse_dataset("text:data/c.txt", base_dir=tmp_path)
    assert spec.path == (tmp_path / "data" / "c.txt").resolve()
    with pytest.raises(DatasetError, match="data/c.txt"):
        parse_dataset("text:data/c.txt", base_dir=tmp_path / "data")


def test_jsonl_reads_field(tmp_path):
    rows = [{"text": "a b", "id": 1}, {"text": "c", "id": 2}]
    f = write(tmp_path / "d.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    spec = parse_dataset(f"jsonl:{f}:text")
    assert spec.field == "text" and spec.path == f.resolve()
    assert load_texts(spec) == ["a b", "c"]


def test_jsonl_bad_json_names_line(tmp_path):
    f = write(tmp_path / "d.jsonl", '{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(DatasetError, match=r"line 2: not valid JSON.*'text'"):
        load_texts(f"jsonl:{f}:text")


def test_jsonl_missing_field_names_line_and_field(tmp_path):
    f = write(tmp_path / "d.jsonl", '{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(DatasetError, match=r"line 2: field 'text' is missing \(keys: body\)"):
        load_texts(f"jsonl:{f}:text")
    g = write(tmp_path / "e.jsonl", '{"text": 3}\n')
    with pytest.raises(DatasetError, match=r"line 1: field 'text' is not a string"):
        load_texts(f"jsonl:{g}:text")


def test_jsonl_without_field(tmp_path):
    with pytest.raises(DatasetError, match="jsonl:PATH:FIELD"):
        parse_dataset("jsonl:only.jsonl")


def test_unknown_spec_lists_forms():
    with pytest.raises(DatasetError) as err:
        parse_dataset("c4")
    msg = str(err.value)
    assert "'c4'" in msg
    for form in ("stdlib", "wikitext2", "text:PATH", "jsonl:PATH:FIELD"):
        assert form in msg
    with pytest.raises(DatasetError, match="train, validation"):
        parse_dataset("stdlib:dev")


def test_stdlib_splits_default_and_disjoint():
    spec = parse_dataset("stdlib")
    assert spec.eval_split == "validation" and str(spec) == "stdlib"
    assert spec.for_calibration().split == "train"
    assert parse_dataset("stdlib:train").eval_split == "train"
    train = {f.rel_path for f in corpus.list_files("train")}
    val = {f.rel_path for f in corpus.list_files("validation")}
    assert train and val and not train & val
    assert len(load_texts(spec)) == len(val)
    with pytest.raises(DatasetError, match="evaluation split"):
        parse_dataset("stdlib:validation").for_calibration()


def test_stdlib_calibration_reads_train_split(monkeypatch):
    seen = []

    def fake_read_texts(split, root=None):
        seen.append(split)
        return ["abcdefghij" * 5]

    monkeypatch.setattr(corpus, "read_texts", fake_read_texts)
    out = calibration_batches(ByteTokenizer(), "stdlib", num_samples=3, seq_len=8, seed=0)
    assert out.shape == (3, 8) and seen == ["train"]


def test_encode_documents_appends_eos():
    ids = encode_documents(ByteTokenizer(), ["ab", "c"])
    assert ids.dtype == torch.long and ids.tolist() == [97, 98, 256, 99, 256]
    assert encode_documents(ByteTokenizer(eos_token_id=None), ["ab", "c"]).tolist() == [97, 98, 99]
    assert encode_documents(ByteTokenizer(), []).shape == (0,)


def test_encode_documents_with_hf_tokenizer():
    """A real fast tokenizer: add_special_tokens=False is honoured and EOS follows each document."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<bos>": 1, "a": 2, "b": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>")
    assert encode_documents(hf, ["a b", "b"]).tolist() == [2, 3, 0, 3, 0]


def test_load_token_documents_is_the_encoded_dataset(tmp_path):
    """parse (against base_dir) -> load_texts -> encode_documents, from a spec string or a DatasetSpec."""
    from slimserve.compress.datasets import load_token_documents

    f = write(tmp_path / "d.jsonl", '{"t": "ab"}\n{"t": "c"}\n')
    want = encode_documents(ByteTokenizer(), ["ab", "c"])
    assert torch.equal(
        load_token_documents("jsonl:d.jsonl:t", ByteTokenizer(), base_dir=tmp_path), want
    )
    assert torch.equal(load_token_documents(parse_dataset(f"jsonl:{f}:t"), ByteTokenizer()), want)
    with pytest.raises(DatasetError, match="dataset file not found"):
        load_token_documents("text:nope.txt", ByteTokenizer(), base_dir=tmp_path)


def test_calibration_batches_seeded_shape_and_windows(tmp_path):
    text = "".join(chr(97 + i % 26) for i in range(300))
    f = write(tmp_path / "c.txt", text)
    tok = ByteTokenizer()
    a = calibration_batches(tok, f"text:{f}", num_samples=5, seq_len=16, seed=7)
    b = calibration_batches(tok, parse_dataset(f"text:{f}"), num_samples=5, seq_len=16, seed=7)
    c = calibration_batches(tok, f"text:{f}", num_samples=5, seq_len=16, seed=8)
    assert a.shape == (5, 16) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    stream = encode_documents(tok, [text])
    for row in a:  # every row is a contiguous window of the stream
        start = next(s for s in range(stream.numel() - 15) if torch.equal(stream[s : s + 16], row))
        assert start + 16 <= stream.numel()


def test_calibration_stream_too_short(tmp_path):
    f = write(tmp_path / "s.txt", "abc")  # 3 bytes + EOS = 4 tokens
    with pytest.raises(DatasetError, match=r"4 tokens.*seq_len \+ 1 = 5"):
        calibration_batches(ByteTokenizer(), f"text:{f}", num_samples=1, seq_len=4, seed=0)
    assert calibration_batches(
        ByteTokenizer(), f"text:{f}", num_samples=2, seq_len=3, seed=0
    ).shape == (2, 3)


def test_wikitext2_load_failure_is_dataset_error(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(ds, "_hub_reachable", lambda *a, **k: True)
    monkeypatch.setattr(datasets, "load_dataset", offline)
    spec = parse_dataset("wikitext2")
    assert spec.eval_split == "test" and spec.for_calibration().split == "train"
    with pytest.raises(
        DatasetError, match=r"could not load wikitext2 \(no network\?\): Couldn't reach.*stdlib"
    ):
        load_texts(spec)


def test_wikitext2_unreachable_hub_fails_fast(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(ds, "_hub_reachable", lambda *a, **k: False)
    t0 = time.perf_counter()
    with pytest.raises(DatasetError, match=r"no network\?.*text:PATH"):
        load_texts("wikitext2")
    assert time.perf_counter() - t0 < 1.0


def test_wikitext2_joins_rows(monkeypatch):
    import datasets

    monkeypatch.setattr(ds, "_hub_reachable", lambda *a, **k: True)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: {"text": [" = A = \n", " b \n"]})
    assert load_texts("wikitext2") == [" = A = \n\n\n b \n"]
