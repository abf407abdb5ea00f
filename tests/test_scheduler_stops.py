"""Scheduler: stop conditions (EOS, ignore_eos, min_tokens, stop token ids, max_tokens, max_model_len) and a finish
by stop string. Driven by hand-made StepResults: no model runs."""

from __future__ import annotations

from executor.request import RequestStatus
from tests.scheduler_fakes import EOS, assert_all_blocks_free, drive, make_request, make_scheduler, prompt_of, step

# --- stop conditions --------------------------------------------------------------------------------------------------


def test_eos_finishes_with_stop() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt_of(6), max_tokens=10)
    scheduler.add_request(request)
    updates = drive(scheduler, [7, 8, EOS, 9, 9])
    assert [u.new_token_ids for u in updates] == [[7], [8], [EOS]]
    assert [u.finished for u in updates] == [False, False, True]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.finish_reason == "stop"
    assert request.stop_reason is None
    assert request.output_token_ids == [7, 8, EOS]
    assert "a" not in scheduler.requests
    assert_all_blocks_free(scheduler)
    assert scheduler.schedule().finished_request_ids == ["a"]


def test_eos_is_ignored_with_ignore_eos() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt_of(6), max_tokens=4, ignore_eos=True)
    scheduler.add_request(request)
    drive(scheduler, [EOS, EOS, EOS, EOS, EOS])
    assert request.output_token_ids == [EOS] * 4
    assert request.finish_reason == "length"


def test_eos_is_ignored_before_min_tokens() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt_of(6), max_tokens=10, min_tokens=3)
    scheduler.add_request(request)
    drive(scheduler, [EOS, EOS, EOS, 9])
    assert request.output_token_ids == [EOS, EOS, EOS]
    assert request.finish_reason == "stop"


def test_stop_token_ids_set_stop_reason() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt_of(6), max_tokens=10, stop_token_ids=[42, 43])
    scheduler.add_request(request)
    drive(scheduler, [7, 43, 9])
    assert request.output_token_ids == [7, 43]
    assert request.finish_reason == "stop"
    assert request.stop_reason == 43


def test_stop_token_ids_respect_min_tokens_but_not_ignore_eos() -> None:
    scheduler = make_scheduler()
    gated = make_request("a", prompt_of(6), max_tokens=10, stop_token_ids=[42], min_tokens=2)
    scheduler.add_request(gated)
    drive(scheduler, [42, 42, 9])
    assert gated.output_token_ids == [42, 42] and gated.stop_reason == 42
    other = make_request("b", prompt_of(6, 50), max_tokens=10, stop_token_ids=[42], ignore_eos=True)
    scheduler.add_request(other)
    drive(scheduler, [EOS, 42, 9])
    assert other.output_token_ids == [EOS, 42] and other.finish_reason == "stop" and other.stop_reason == 42


def test_max_tokens_finishes_with_length() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt_of(6), max_tokens=3)
    scheduler.add_request(request)
    updates = drive(scheduler, [7, 8, 9, 10])
    assert request.output_token_ids == [7, 8, 9]
    assert request.finish_reason == "length" and request.stop_reason is None
    assert updates[-1].finished and not any(u.finished for u in updates[:-1])
    assert_all_blocks_free(scheduler)


def test_max_model_len_finishes_with_length() -> None:
    scheduler = make_scheduler(max_model_len=20)
    request = make_request("a", prompt_of(16), max_tokens=100)
    scheduler.add_request(request)
    drive(scheduler, [7] * 10)
    assert request.num_tokens == 20
    assert request.num_output_tokens == 4
    assert request.finish_reason == "length"


def test_eos_on_the_last_allowed_token_is_a_stop() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt_of(6), max_tokens=2)
    scheduler.add_request(request)
    drive(scheduler, [7, EOS])
    assert request.finish_reason == "stop"


def test_finish_with_stop_string_records_reason() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt_of(6), max_tokens=10)
    scheduler.add_request(request)
    step(scheduler)
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED, "###")
    assert request.finish_reason == "stop" and request.stop_reason == "###"
    assert_all_blocks_free(scheduler)
