"""The decode roofline model (benchmarks/roofline.py) reproduces the plan arithmetic of issue #12."""
import itertools

import pytest

from benchmarks.roofline import Device, DecodeWork, predict, work_after, work_before

LLAMA3_8B = (32, 8, 128)  # Hq, Hkv, D


def test_before_plan_matches_the_issue_figures():
    """B=64, L=512, W=256: 8,192 programs, 14 of 16 splits empty, partials 102% of K/V."""
    w = work_before(64, *LLAMA3_8B, 512, width=256)
    assert w.programs == 8192
    assert w.active_programs == 8192 * 2 // 16
    assert w.partial_bytes / w.useful_bytes == pytest.approx(1.02, abs=0.01)
    assert work_before(1, *LLAMA3_8B, 4096, width=256).programs == 128


@pytest.mark.parametrize("batch,length",
                         list(itertools.product((1, 8, 32, 64), (512, 4096, 16384))))
def test_after_plan_has_no_empty_programs_and_bounded_partials(batch, length):
    w = work_after(batch, *LLAMA3_8B, length, width=max(256, length // 16))
    assert w.active_programs == w.programs
    assert w.programs <= Device().num_sms * 4 or w.partial_bytes == 0
    assert w.partial_bytes <= w.useful_bytes / 8 * 1.05  # lse bytes on top of the o budget


def test_prediction_responds_to_traffic_and_parallelism():
    base = DecodeWork(programs=512, active_programs=512, resident_per_sm=4,
                      in_flight_bytes=32768, useful_bytes=1 << 28, partial_bytes=0,
                      other_bytes=0, launches=0)
    more_traffic = predict(DecodeWork(**{**base.__dict__, "partial_bytes": 1 << 27}))
    fewer_programs = predict(DecodeWork(**{**base.__dict__, "programs": 32,
                                           "active_programs": 32}))
    full = predict(base)
    assert 0.9 < full["hbm_fraction"] <= 1.0
    assert more_traffic["hbm_fraction"] == pytest.approx(full["hbm_fraction"] / 1.5, rel=0.01)
    assert fewer_programs["hbm_fraction"] < full["hbm_fraction"] / 2
