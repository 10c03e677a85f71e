"""The comparison's controls (ntil_ds.comparison.controls) on real synthetic splits: the answer-ignoring
constants against a brute force over every candidate with the scoring's own functions, the shuffled
split item by item, and its chance level against what a model that reads the image it is shown scores."""

import json
from pathlib import Path

import pytest

from ntil_ds.comparison import controls
from ntil_ds.comparison.outputs import write_outputs
from ntil_ds.comparison.results import RunResult
from ntil_ds.data import read_jsonl, split_last_answer
from ntil_ds.data.records import text_of
from ntil_ds.data.synthetic import write_dataset
from ntil_ds.scoring import MINUTES_ON_DIAL, score


@pytest.fixture(scope="module")
def clocks(tmp_path_factory):
    return write_dataset("clock", 60, tmp_path_factory.mktemp("clocks"), seed=3, difficulty="standard")


def test_best_clock_constant_is_the_least_deviation_over_every_dial_time(clocks):
    train = controls.answers(clocks["train"])
    best = controls.best_constant("clock", train)

    def mean_deviation(minutes):
        text = f"{minutes // 60 or 12:02d}:{minutes % 60:02d}"
        return score("clock", [text] * len(train), train)["clock_dev_minutes"]

    brute = min(mean_deviation(m) for m in range(MINUTES_ON_DIAL))
    assert score("clock", [best] * len(train), train)["clock_dev_minutes"] == pytest.approx(brute)
    scored = controls.control_scores("clock", [clocks["train"]], clocks["test"])
    test = controls.answers(clocks["test"])
    constant = scored["constants"]["best constant (train median)"]
    assert constant["answer"] == best
    assert constant["metrics"]["clock_dev_minutes"] == pytest.approx(
        score("clock", [best] * len(test), test)["clock_dev_minutes"]
    )


def test_number_and_box_constants_by_hand():
    assert controls.best_constant("arithmetic", ["1", "2", "10", "100", "7"]) == "7"  # the median
    assert controls.best_constant("arithmetic", ["1", "2", "10", "100"]) == "6"  # (2 + 10) / 2
    assert controls.best_constant("chart", ["1.5", "2.5", "4"]) == "2.5"
    boxes = ["[0, 0, 10, 10]", "[2, 4, 20, 30]", "[8, 1, 12, 12]"]
    assert controls.best_constant("boxes", boxes) == "[2, 1, 12, 12]"  # coordinate by coordinate
    with pytest.raises(ValueError, match="parses as a box"):
        controls.best_constant("boxes", ["none"])


def test_one_cycle_has_no_fixed_point_and_is_seeded():
    for n in (2, 3, 10, 200):
        p = controls.one_cycle(n)
        assert sorted(p) == list(range(n)) and all(p[i] != i for i in range(n))
        seen, i = set(), 0
        while i not in seen:  # one cycle through every item
            seen.add(i)
            i = p[i]
        assert len(seen) == n
    assert controls.one_cycle(50, seed=1) == controls.one_cycle(50, seed=1) != controls.one_cycle(50, seed=2)


def test_shuffled_split_and_chance(clocks, tmp_path):
    shuffled = controls.write_shuffled_split(clocks["test"], tmp_path / "s.jsonl", n=5)
    original = [c for _, c in read_jsonl(clocks["test"])][:5]
    rows = [c for _, c in read_jsonl(tmp_path / "s.jsonl")]
    assert shuffled["n"] == 5 and len(rows) == 5
    for i, row in enumerate(rows):
        source = original[shuffled["permutation"][i]]
        assert row.images == [p.resolve() for p in source.images]  # another item's image
        assert split_last_answer(row)[2] == split_last_answer(original[i])[2]  # its own answer
        assert [text_of(m) for m in row.messages[:-1]] == [text_of(m) for m in original[i].messages[:-1]]
    truth = [split_last_answer(c)[2] for c in original]
    chance = controls.shuffled_chance("clock", clocks["test"], shuffled)
    # a model that reads: on the shuffled split it answers the time of the image it is shown
    reader = [truth[p] for p in shuffled["permutation"]]
    assert score("clock", reader, truth)["clock_dev_minutes"] == chance["clock_dev_minutes"]
    assert chance["clock_acc"] < 1 and chance["clock_dev_minutes"] > 0
    # a text-only split has nothing to shuffle
    text = write_dataset("arithmetic", 20, tmp_path / "arith", seed=0, difficulty="easy")
    assert controls.write_shuffled_split(text["test"], tmp_path / "t.jsonl", n=5) is None


def test_the_table_carries_the_controls(clocks, tmp_path):
    scored = controls.control_scores("clock", [clocks["train"]], clocks["test"])
    shuffled = controls.write_shuffled_split(clocks["test"], tmp_path / "s.jsonl", n=4)
    scored["shuffled"] = shuffled | {"chance": controls.shuffled_chance("clock", clocks["test"], shuffled)}
    runs = [
        RunResult(
            label,
            label,
            seed,
            str(tmp_path / f"{label}{seed}"),
            status="ok",
            metrics={"clock_dev_minutes": 90.0 + seed, "clock_acc": 0.1, "parse_rate": 1.0},
            shuffled={"clock_dev_minutes": 150.0 + seed},
        )
        for label in ("ce", "ntil")
        for seed in (0, 1)
    ]
    header = {"task": "clock", "test_split": str(clocks["test"]), "controls": scored}
    report = write_outputs(
        tmp_path, runs, ("clock_dev_minutes", "clock_acc", "parse_rate"), "ce", header, "t"
    )
    table = (tmp_path / "table.md").read_text()
    best = scored["constants"]["best constant (train median)"]
    assert (
        f"| best constant (train median) | {best['answer']} | {best['metrics']['clock_dev_minutes']:.4g} |"
        in table
    )
    chance = scored["shuffled"]["chance"]["clock_dev_minutes"]
    assert f"| ce | 150.5 ± 0.71 (2 runs) | 90.5 | {chance:.4g} |" in table
    assert json.loads((tmp_path / "results.json").read_text())["controls"] == json.loads(json.dumps(scored))
    assert report["paired"]["ntil"]["clock_dev_minutes"]["difference"]["mean"] == 0


def test_split_hash_covers_the_images_and_items_are_hashed_by_content(clocks, tmp_path):
    """A test split drawn again at the same path (same JSONL bytes, other images) is another split;
    a copy elsewhere is the same; one draw's splits share no item."""
    import shutil

    from ntil_ds.comparison.splits import item_hashes, split_hash

    folder = Path(clocks["test"]).parent
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    assert split_hash(copy / "test.jsonl") == split_hash(clocks["test"])
    assert item_hashes(copy / "test.jsonl").keys() == item_hashes(clocks["test"]).keys()
    first, second = sorted((copy / "images" / "test").iterdir())[:2]
    shutil.copy(second, first)  # one image redrawn, the JSONL untouched
    assert (copy / "test.jsonl").read_bytes() == Path(clocks["test"]).read_bytes()
    assert split_hash(copy / "test.jsonl") != split_hash(clocks["test"])
    assert len(item_hashes(copy / "test.jsonl").keys() & item_hashes(clocks["test"]).keys()) == 5
    assert not item_hashes(clocks["test"]).keys() & item_hashes(clocks["train"]).keys()


def test_the_grid_prepares_the_controls_and_an_export_reads_the_shuffled_split(clocks, tmp_path):
    """What ``Comparison.run`` does before its first job, on a clock recipe: the constants and the
    shuffled split with its chance; then what it does after each job's scoring: the export scored on
    that split by the real evaluation (a random tiny Qwen2-VL here: the file must load and generate)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ntil_ds.comparison.grid import Comparison
    from ntil_ds.comparison.plan import plan_comparison
    from ntil_ds.evaluation.generate import score_exported_model
    from ntil_ds.jobs import REPO_ROOT
    from ntil_ds.tiny import build_tiny_model_folder

    (tmp_path / "out").mkdir()
    plan = plan_comparison(
        REPO_ROOT / "configs" / "train" / "tiny_qwen2vl_clock.yaml",
        tmp_path / "out",
        [("ce", "ce", ["loss.name=ce"])],
        [0],
        nproc=1,
        overrides=[f"data.train_file={clocks['train']}", f"tracking.uri=sqlite:///{tmp_path / 'm.db'}"],
        test_split=Path(clocks["test"]),
        task=None,
        command="compare.py",
        shuffled_n=4,
    )
    prepared = Comparison(plan).prepare_controls()
    assert (
        prepared["constants"]
        == controls.control_scores("clock", [clocks["train"]], clocks["test"])["constants"]
    )
    shuffled = prepared["shuffled"]
    assert shuffled["n"] == 4 and shuffled["path"] == str(tmp_path / "out" / "runs" / controls.SHUFFLED_FILE)
    assert shuffled["chance"] == controls.shuffled_chance("clock", clocks["test"], shuffled)
    folder = build_tiny_model_folder("qwen2_vl", tmp_path / "model")
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    report = score_exported_model(folder, Path(shuffled["path"]), "clock", batch_size=4, max_new_tokens=6)
    assert report["metrics"]["n"] == 4
    references = [row["reference"] for row in report["samples"]]
    assert references == controls.answers(clocks["test"])[:4]  # scored against each item's own answer
    # off: no shuffled split
    off = plan_comparison(
        plan.recipe,
        plan.out,
        plan.specs,
        [0],
        nproc=1,
        overrides=[f"data.train_file={clocks['train']}", f"tracking.uri=sqlite:///{tmp_path / 'm.db'}"],
        test_split=Path(clocks["test"]),
        task=None,
        command="compare.py",
        shuffled_n=0,
    )
    assert "shuffled" not in Comparison(off).prepare_controls()
