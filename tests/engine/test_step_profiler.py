"""--enable_profile_step_time: per-step phase times, logged as window summaries."""
import logging

from heterollm import LLM, SamplingParams
from heterollm.engine.step_profiler import PHASES, StepProfiler

from helpers import build_tiny_model


def test_summary_splits_decode_and_prefill(caplog):
    prof = StepProfiler(window=3)
    with caplog.at_level(logging.INFO, logger="heterollm.profile"):
        prof.record(2, 40, 0.001, {"prepare": 0.002, "forward": 0.1, "sample": 0.01}, 0.003)
        prof.record(2, 2, 0.001, {"prepare": 0.001, "forward": 0.02, "sample": 0.004}, 0.001)
        assert not caplog.records
        prof.record(2, 2, 0.001, {"prepare": 0.001, "forward": 0.04, "sample": 0.004}, 0.001)
    [rec] = caplog.records
    text = rec.getMessage()
    assert "3 steps to #3" in text
    assert "decode x2 (2.0 seqs, 2 tokens): 37.0 ms" in text and "forward 30.00" in text
    assert "prefill/mixed x1 (2.0 seqs, 40 tokens): 116.0 ms" in text
    assert prof.records == []


def test_engine_logs_every_phase(tmp_path, caplog):
    folder = build_tiny_model(tmp_path / "m", "llama")
    llm = LLM(str(folder), dtype="float32", enable_profile_step_time=True)
    with caplog.at_level(logging.DEBUG, logger="heterollm.profile"):
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        llm.shutdown()
    steps = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(steps) == 4 and steps[0].startswith("step 1: 2 seqs, 5 tokens,")
    assert all(all(p in s for p in PHASES) for s in steps)
    assert any("step time: 4 steps to #4" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


def test_off_by_default(tmp_path):
    folder = build_tiny_model(tmp_path / "m", "llama")
    assert LLM(str(folder), dtype="float32").engine.profiler is None


def test_step_lines_and_the_speculative_summary_word_for_word(caplog):
    """Expected text by hand: the phases in milliseconds, 'draft' counted as sampling; two
    verifications of 3 drafts each accepting 2 and 1: 3 of 6 accepted is 50.0%, and each step
    yields its accepted drafts plus one token, (2 + 1) / 2 + 1 = 2.50."""
    prof = StepProfiler(window=2)
    with caplog.at_level(logging.DEBUG, logger="heterollm.profile"):
        prof.record(1, 4, 0.001, {"prepare": 0.002, "forward": 0.004, "sample": 0.001, "draft": 0.002}, 0.0005,
                    spec=(1, 3, 2))
        prof.record(1, 4, 0.001, {"prepare": 0.002, "forward": 0.004, "sample": 0.003}, 0.0005, spec=(1, 3, 1))
    first, second, summary = (r.getMessage() for r in caplog.records)
    assert first == ("step 1: 1 seqs, 4 tokens, schedule 1.00 prepare 2.00 forward 4.00 sample 3.00 "
                     "output 0.50, 2/3 drafts accepted")
    assert second.endswith(", 1/3 drafts accepted")
    assert summary.endswith("speculative: 6 drafts in 2 verifications, acceptance 50.0%, "
                            "mean accepted length 2.50 tokens per step")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="heterollm.profile"):
        prof.record(1, 1, 0.001, {"forward": 0.002}, 0.001)
    assert caplog.records[0].getMessage() == ("step 3: 1 seqs, 1 tokens, schedule 1.00 prepare 0.00 forward 2.00 "
                                              "sample 0.00 output 1.00")
