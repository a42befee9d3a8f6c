import pytest

from service.admission import Admission, QueueFullError, ShuttingDown
from service.engine.base import RequestTooLargeError


def test_a_request_no_wait_could_admit_is_the_clients_error():
    admission = Admission(max_num_seqs=32, max_queue=256, max_seqs_per_request=288)
    admission.check_size(1, 32)
    admission.check_size(288, 1)
    for prompts, n, param in ((1, 33, "n"), (1000, 1, "prompt"), (255, 32, "prompt"), (10, 29, "prompt")):
        with pytest.raises(RequestTooLargeError) as raised:
            admission.check_size(prompts, n)
        assert raised.value.param == param and "NIM_MAX" in str(raised.value)
    admission.check_size(1, 288, together=False)  # vLLM runs a request's choices as they fit
    with pytest.raises(RequestTooLargeError):
        admission.check_size(1, 289, together=False)


def test_in_flight_is_bounded_by_running_plus_waiting_and_released():
    admission = Admission(max_num_seqs=2, max_queue=1, max_seqs_per_request=3)
    for _ in range(3):
        admission.enter()
    with pytest.raises(QueueFullError):
        admission.enter()
    admission.enter(bounded=False)  # a request that generates nothing is counted, never refused
    assert admission.in_flight == 4
    admission.leave()
    admission.leave()
    admission.enter()
    assert admission.in_flight == 3


def test_draining_refuses_every_new_request():
    admission = Admission(max_num_seqs=2, max_queue=1, max_seqs_per_request=3)
    admission.draining = True
    for bounded in (True, False):
        with pytest.raises(ShuttingDown):
            admission.enter(bounded)
    assert admission.in_flight == 0
