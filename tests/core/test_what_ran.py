"""docs/what-ran.md is the one statement of what ran where: checked against the committed GPU results and nox pins,
and every page must link it instead of saying "never ran on a GPU" about a path that did (what_ran_check.py)."""
import os
import shutil

import pytest

from what_ran_check import check, check_matrix, gpu_evidence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def copy(tmp_path):
    """The pages, the matrix, the results and the noxfile, in a temporary tree to plant mistakes in."""
    dst = tmp_path / "repo"
    shutil.copytree(os.path.join(ROOT, "docs"), dst / "docs", ignore=shutil.ignore_patterns("ab"))
    shutil.copytree(os.path.join(ROOT, "benchmarks", "gpu", "results"), dst / "benchmarks" / "gpu" / "results")
    for f in ("README.md", "noxfile.py"):
        shutil.copy(os.path.join(ROOT, f), dst / f)
    return str(dst)


def _append(root, rel, text):
    with open(os.path.join(root, rel), "a", encoding="utf-8") as f:
        f.write("\n\n" + text + "\n")


def _replace(root, rel, old, new, count=1):
    path = os.path.join(root, rel)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert old in text
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(old, new, count))


def test_the_repository_agrees_with_its_matrix():
    assert check(ROOT) == []


def test_the_evidence_is_read_from_the_committed_runs():
    runs, clean, devices = gpu_evidence(ROOT)
    assert runs[("2026-12-04", 3, "megatron")] == (13, 13)
    assert {"kernel", "trl", "fsdp2", "deepspeed", "megatron"} <= clean
    assert devices == 1


def test_a_planted_never_ran_on_a_gpu_fails(copy):
    assert check(copy) == []
    _append(copy, "docs/gpu-paths.md", "None of this has run on a GPU.")
    found = check(copy)
    assert len(found) == 1 and "gpu-paths.md" in found[0] and "without linking" in found[0]


def test_a_planted_statement_that_names_a_path_that_ran_fails_even_with_the_link(copy):
    _append(copy, "docs/trl.md", "The TRL path never ran on a GPU ([what ran where](what-ran.md)).")
    found = check(copy)
    assert len(found) == 1 and "['trl'] ran" in found[0]


def test_statements_about_more_gpus_or_engines_pass(copy):
    _append(copy, "docs/trl.md", "TRL has not run on more than one GPU ([what ran where](what-ran.md)).")
    assert check(copy) == []


def test_a_matrix_cell_that_disagrees_with_the_results_fails(copy):
    _replace(copy, "docs/what-ran.md", "run3 `megatron` 13/13", "run3 `megatron` 12/13")
    assert any("12/13" in p for p in check_matrix(copy))
    _replace(copy, "docs/what-ran.md", "run3 `megatron` 12/13 (megatron-core 0.16.1)", "")
    _replace(copy, "docs/what-ran.md", "**ran** 2026-12-04: ", "not run ", )
    assert any("ran on a GPU (benchmarks/gpu/results) but the cell says" in p for p in check_matrix(copy))


def test_a_version_the_noxfile_does_not_pin_fails(copy):
    _replace(copy, "docs/what-ran.md", "`trl==1.16.0`", "`trl==1.17.0`")
    assert any("trl==1.17.0" in p for p in check_matrix(copy))


def test_a_page_without_the_link_fails(copy):
    _replace(copy, "docs/doctor.md", "what-ran.md", "matrix.md", count=-1)
    assert any("doctor.md: does not link" in p for p in check(copy))
