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


def test_the_e2e_summary_carries_the_worst_log_prob_mismatch_of_every_step():
    """benchmarks/e2e_vs_peers.py: a run's summary and table report the largest
    sampler/trainer mismatch of any step (step 1 included) and the samples audited per step;
    a peer that reports none shows '-'."""
    from benchmarks import e2e_vs_peers

    def run(variant, system, mismatches):
        rows = [dict(seconds=1.0, generation_seconds=0.4, update_seconds=0.6, peak_rss_mib=1,
                     reward=0.0, **({} if mismatches is None else dict(
                         logprob_mismatch_max=m, audited=16, compiles=0, audit_seconds=0.0,
                         cpu_seconds=1.0))) for m in (mismatches or [None] * 3)]
        return dict(variant=variant, system=system, rc=0, steps=rows, load_before=[0] * 3,
                    load_after=[0] * 3)

    ours = run("jaxrl-bf16", "jaxrl-bf16", [0.25, 0.0, 0.0])  # only step 1 is off
    summary = e2e_vs_peers.summarise(ours)
    assert summary["logprob_mismatch_max"] == 0.25
    assert summary["audited_per_step"] == [16, 16, 16]
    table = e2e_vs_peers.markdown([ours, run("trl-2t-bf16", "trl-bf16", None)], "2x8x24", 3)
    assert "| 0 | 0.25 |" in table and table.rstrip().count("| - | - |") == 1
