"""Prompt sources: deterministic cursor, state/restore, epoch wrap, file loading and errors."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxloop.data.datasets import (
    BuiltinSource,
    DataError,
    Example,
    FileSource,
    load_examples,
    make_eval_examples,
    make_source,
)
from jaxloop.data.tasks import BuiltinTask

ROWS = [{"prompt": f"question {i}?", "label": str(i * 7)} for i in range(10)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def jsonl(tmp_path):
    return write_jsonl(tmp_path / "data.jsonl", ROWS)


def drain(source, sizes):
    return [ex for n in sizes for ex in source.next_batch(n)]


# ----- BuiltinSource --------------------------------------------------------------------------
def test_builtin_deterministic_and_batch_size_independent():
    task = BuiltinTask("copy_last", 4, seed=0)
    a, b = BuiltinSource(task, seed=5), BuiltinSource(task, seed=5)
    assert drain(a, [3, 5, 8]) == drain(b, [16])
    assert drain(a, [4]) == [task.prompt("train", i, seed=5) for i in range(16, 20)]
    c = BuiltinSource(task, seed=6)
    assert drain(c, [20]) != drain(BuiltinSource(task, seed=5), [20])
    assert len(a) == 10_000


def test_builtin_state_restore_identical_continuation():
    task = BuiltinTask("max_digit", 4)
    a = BuiltinSource(task, seed=1)
    a.next_batch(37)
    state = json.loads(json.dumps(a.state()))  # JSON-serialisable
    assert state["epoch"] == 0 and state["position"] == 37 and state["seed"] == 1
    expected = drain(a, [13, 64])
    b = BuiltinSource(task, seed=999)  # seed comes from the state
    b.restore(state)
    assert drain(b, [77]) == expected
    with pytest.raises(DataError, match="task"):
        BuiltinSource(BuiltinTask("copy_first", 4)).restore(state)


def test_builtin_epoch_wrap_keeps_stream():
    task = BuiltinTask("sum_mod10")  # 100 prompts -> nominal epoch of 100
    a = BuiltinSource(task, seed=0)
    first = drain(a, [150])
    assert a.state()["epoch"] == 1 and a.state()["position"] == 50
    assert first == [task.prompt("train", i) for i in range(150)]


# ----- FileSource -----------------------------------------------------------------------------
def test_file_epoch_permutations(jsonl):
    src = FileSource(jsonl, seed=3)
    assert len(src) == 10
    got = drain(src, [4, 4, 4, 4, 4, 5])  # 25 = 2.5 epochs, batches span epoch boundaries
    all_rows = {Example(r["prompt"], r["label"]) for r in ROWS}
    e0, e1, e2 = got[:10], got[10:20], got[20:]
    assert set(e0) == all_rows and set(e1) == all_rows and len(set(e2)) == 5
    assert e0 != e1  # reshuffled per epoch
    assert e0 != [Example(r["prompt"], r["label"]) for r in ROWS]  # shuffled at all
    assert src.state()["epoch"] == 2 and src.state()["position"] == 5
    # the same seed gives the same order; another seed a different one
    assert drain(FileSource(jsonl, seed=3), [25]) == got
    assert drain(FileSource(jsonl, seed=4), [25]) != got


def test_file_state_restore(jsonl):
    a = FileSource(jsonl, seed=0)
    a.next_batch(13)
    state = json.loads(json.dumps(a.state()))
    expected = drain(a, [9, 11])
    b = FileSource(jsonl, seed=7)
    b.next_batch(3)  # cursor elsewhere, cached permutation of another epoch
    b.restore(state)
    assert drain(b, [20]) == expected


def test_file_restore_rejects_changed_data(jsonl, tmp_path):
    state = FileSource(jsonl).state()
    other = write_jsonl(tmp_path / "other.jsonl", ROWS[:9])
    with pytest.raises(DataError, match="size 10 but"):
        FileSource(other).restore(state)
    changed = write_jsonl(tmp_path / "changed.jsonl", [*ROWS[:9], {"prompt": "x", "label": "y"}])
    with pytest.raises(DataError, match="digest"):
        FileSource(changed).restore(state)
    with pytest.raises(DataError, match="builtin"):
        FileSource(jsonl).restore(BuiltinSource(BuiltinTask()).state())
    with pytest.raises(DataError, match="bad data-source state"):
        FileSource(jsonl).restore({"epoch": 0})


def test_parquet_equals_jsonl(jsonl, tmp_path):
    pq_path = write_parquet(tmp_path / "data.parquet", ROWS)
    assert load_examples(pq_path) == load_examples(jsonl)
    assert drain(FileSource(pq_path, seed=2), [23]) == drain(FileSource(jsonl, seed=2), [23])


def test_numeric_labels_and_extra_fields(tmp_path):
    rows = [{"prompt": "1+1?", "label": 2, "id": 0}, {"prompt": "half?", "label": 0.5}]
    assert load_examples(write_jsonl(tmp_path / "n.jsonl", rows)) == [
        Example("1+1?", "2"),
        Example("half?", "0.5"),
    ]


@pytest.mark.parametrize(
    "name,content,match",
    [
        ("empty.jsonl", "", "no rows"),
        ("blank.jsonl", "\n  \n", "no rows"),
        ("badjson.jsonl", '{"prompt": "a", "label": "b"}\n{"prompt": \n', "line 2 is not valid"),
        ("nolabel.jsonl", '{"prompt": "a"}\n', r"line 1 is missing field\(s\) \['label'\]"),
        ("noprompt.jsonl", '{"question": "a", "label": "b"}\n', r"\['prompt'\]"),
        ("list.jsonl", "[1, 2]\n", "expected an object"),
        ("emptylabel.jsonl", '{"prompt": "a", "label": " "}\n', "empty label"),
        ("dictlabel.jsonl", '{"prompt": "a", "label": {"x": 1}}\n', "label of type dict"),
        ("data.csv", "prompt,label\na,b\n", "unsupported data file type"),
    ],
)
def test_bad_jsonl_files(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=match) as info:
        FileSource(path)
    msg = str(info.value)
    assert str(path) in msg and "\n" not in msg
    assert isinstance(info.value, ValueError)


def test_bad_parquet_files(tmp_path):
    path = write_parquet(tmp_path / "cols.parquet", [{"question": "a", "answer": "b"}])
    with pytest.raises(DataError, match=r"row 0 is missing field\(s\) \['prompt', 'label'\]"):
        FileSource(path)
    empty = tmp_path / "empty.parquet"
    pq.write_table(
        pa.table({"prompt": pa.array([], pa.string()), "label": pa.array([], pa.string())}), empty
    )
    with pytest.raises(DataError, match="no rows"):
        FileSource(empty)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="cannot read Parquet"):
        FileSource(garbage)
    nulls = write_parquet(tmp_path / "nulls.parquet", [{"prompt": "a", "label": None}])
    with pytest.raises(DataError, match="row 0 is missing"):
        FileSource(nulls)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found") as info:
        make_source({"source": str(tmp_path / "nope.jsonl"), "seed": 0})
    assert "nope.jsonl" in str(info.value)


# ----- make_source / make_eval_examples ---------------------------------------------------------
def test_make_source_builtin_and_file(jsonl):
    src = make_source({"source": "builtin", "task": "copy_first", "num_digits": 3, "seed": 4})
    assert isinstance(src, BuiltinSource)
    assert (src.task.name, src.task.num_digits, src.seed) == ("copy_first", 3, 4)
    assert src.next_batch(2) == [
        BuiltinTask("copy_first", 3).prompt("train", i, seed=4) for i in (0, 1)
    ]
    fsrc = make_source({"source": str(jsonl), "task": None, "num_digits": 4, "seed": 1})
    assert isinstance(fsrc, FileSource) and len(fsrc) == 10
    assert make_source({}).task.name == BuiltinTask().name  # defaults


def test_make_source_config_dict(jsonl):
    import ml_collections

    cfg = ml_collections.ConfigDict(
        {"source": "builtin", "task": "sum_mod10", "num_digits": 4, "seed": 2}
    )
    assert make_source(cfg).task.name == "sum_mod10"
    cfg = ml_collections.ConfigDict({"source": str(jsonl), "seed": 2})
    assert isinstance(make_source(cfg), FileSource)


def test_make_eval_examples(jsonl):
    cfg = {"source": "builtin", "task": "copy_last", "num_digits": 4, "seed": 9}
    assert make_eval_examples(cfg, 8) == BuiltinTask("copy_last", 4).eval_examples(8)
    assert make_eval_examples({"source": str(jsonl)}, 8) == []
    assert (
        make_eval_examples({"source": str(jsonl), "eval_source": str(jsonl)}, 3)
        == load_examples(jsonl)[:3]
    )
