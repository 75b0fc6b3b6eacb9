"""benchmarks/kernel_ab.py's side settings (one checkout under two environments), without
running W1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kernel_ab


def test_side_settings_become_an_environment():
    assert kernel_ab.side_environment(["KVSERVE_PROJECTIONS=hybrid", "A=b=c", "EMPTY="]) == \
        {"KVSERVE_PROJECTIONS": "hybrid", "A": "b=c", "EMPTY": ""}
    assert kernel_ab.side_environment([]) == {}


@pytest.mark.parametrize("setting", ["KVSERVE_PROJECTIONS", "=hybrid", " =x"])
def test_a_setting_without_a_name_or_an_equals_sign_is_refused(setting):
    with pytest.raises(ValueError, match="is not VAR=VALUE"):
        kernel_ab.side_environment([setting])


def test_a_run_without_kernel_cases_says_so_and_keeps_the_w1_table():
    section = kernel_ab.markdown([], [{"base": 40.0, "head": 36.0}], 0, "python x",
                                 ("abc KVSERVE_PROJECTIONS=onednn",
                                  "abc KVSERVE_PROJECTIONS=hybrid"), ["1 / 1 / 1"] * 3)
    assert "Kernel cases: not run (`--reps 0`)." in section
    assert "| case |" not in section
    assert "head = abc KVSERVE_PROJECTIONS=hybrid" in section
    assert "| 1 | 40.0 | 36.0 | 1.111 |" in section


def test_bad_side_settings_exit_with_code_2(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["kernel_ab.py", "--base", "src", "--head-env", "X"])
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    with pytest.raises(SystemExit) as exit_info:
        kernel_ab.main()
    assert exit_info.value.code == 2
    assert "--base-env / --head-env: 'X' is not VAR=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["kernel ab", "a-b", "x:y", ""])
def test_a_section_name_outside_its_markers_alphabet_exits_with_code_2(monkeypatch, capsys,
                                                                        name):
    monkeypatch.setattr(sys, "argv", ["kernel_ab.py", "--base", "src", "--section", name])
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    with pytest.raises(SystemExit) as exit_info:
        kernel_ab.main()
    assert exit_info.value.code == 2
    assert f"--section {name!r}: letters, digits and _ only" in capsys.readouterr().err


def test_a_named_section_is_written_beside_the_default_one(tmp_path):
    from docs_section import write_section

    docs = tmp_path / "benchmarks.md"
    write_section("kernel_ab", "## default run", docs)
    write_section("kernel_ab_decode", "## named run", docs)
    write_section("kernel_ab", "## default run again", docs)
    text = docs.read_text()
    assert "## named run" in text and "## default run again" in text
    assert "## default run\n" not in text
