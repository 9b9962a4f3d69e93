"""The exception hierarchy: one class per loom::StatusCode, with the rank, the op and the reason."""

import pytest

import loom
from loom import _errors

CODES = {
    "invalid_argument": (loom.InvalidArgument, ValueError),
    "unsupported": (loom.Unsupported, None),
    "timeout": (loom.Timeout, TimeoutError),
    "peer_failure": (loom.PeerFailure, None),
    "cuda_error": (loom.CudaError, None),
    "system_error": (loom.SystemCallError, OSError),
    "aborted": (loom.Aborted, None),
    "internal": (loom.InternalError, None),
}


@pytest.mark.parametrize("code", sorted(CODES))
def test_every_status_code_has_its_class(code):
    cls, builtin = CODES[code]
    error = _errors._from_status(code, "all_gather", 3, "rank 1 never signalled")
    assert type(error) is cls
    assert isinstance(error, loom.LoomError) and isinstance(error, RuntimeError)
    if builtin is not None:
        assert isinstance(error, builtin)
    assert error.code == code
    assert (error.rank, error.op, error.reason) == (3, "all_gather", "rank 1 never signalled")
    assert str(error) == "loom rank 3: all_gather: rank 1 never signalled"


def test_unknown_code_is_internal_and_no_rank_is_omitted():
    error = _errors._from_status("what", "gemm", None, "odd")
    assert type(error) is loom.InternalError
    assert str(error) == "loom: gemm: odd"


def test_errors_can_be_raised_and_caught_by_builtin():
    with pytest.raises(ValueError, match="bad shape"):
        raise _errors._invalid("gemm", "bad shape")
    with pytest.raises(TimeoutError):
        raise _errors._from_status("timeout", "barrier", 0, "late")
