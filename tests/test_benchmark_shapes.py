"""The benchmarks' --shape argument (benchmarks/peers/common.py `parse_shape`, used by the
peer children, e2e_vs_peers.py and exact_cost.py): the sizes it names, a usage error for
anything else."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))
import common  # noqa: E402

from benchmarks import exact_cost  # noqa: E402


def test_a_shape_names_prompts_group_and_new_tokens():
    assert common.parse_shape("8x8x128") == (8, 8, 128)
    assert common.parse_shape("2X8X24") == (2, 8, 24)


@pytest.mark.parametrize("bad", ["8x8", "2x8x24x1", "0x8x24", "-1x8x24", "8xax24", ""])
def test_a_malformed_shape_is_a_value_error_naming_the_form(bad):
    with pytest.raises(ValueError, match="PxGxT with positive integers"):
        common.parse_shape(bad)


def test_exact_cost_refuses_a_bad_shape_before_running_anything(capsys):
    with pytest.raises(SystemExit) as exit_info:
        exact_cost.main(["--shape", "8xa", "--base-tree", "/nonexistent",
                         "--exact-tree", "/nonexistent"])
    assert exit_info.value.code == 2  # argparse's usage error, not a traceback
    assert "PxGxT with positive integers" in capsys.readouterr().err
