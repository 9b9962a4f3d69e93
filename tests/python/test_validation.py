"""Argument checks of the low-level API, which run before anything is launched. CPU arrays
(numpy, CPU torch tensors) reach every rule: shapes and dtypes are checked before the device, so a
call with correct shapes fails on the device check, which proves the shape rules passed.
`_C._check_args(op, world, tensors)` runs the checks of the communicator ops with `world`
standing in for the communicator."""

import contextlib

import pytest

np = pytest.importorskip("numpy")

import loom
from loom import _C

torch = pytest.importorskip("torch")


def z(*shape, dtype=np.float16):
    return np.zeros(shape, dtype)


def t(*shape, dtype=None):
    return torch.zeros(shape, dtype=dtype or torch.bfloat16)


@contextlib.contextmanager
def raises(cls, *fragments):
    """pytest.raises that also checks each fragment is in the message."""
    with pytest.raises(cls) as info:
        yield info
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


# ---- gemm ---------------------------------------------------------------------------------------

def test_gemm_correct_shapes_fail_only_on_the_device():
    with raises(loom.InvalidArgument, "loom: gemm:", "a is on cpu", "CUDA device memory"):
        _C.gemm(z(128, 64), z(64, 32), z(128, 32), 0)


def test_gemm_non_cuda_tensor_is_a_value_error():
    with pytest.raises(ValueError):
        _C.gemm(t(128, 64), t(64, 32), t(128, 32), 0)


@pytest.mark.parametrize("dtype,name", [(np.float64, "float64"), (np.int32, "int32"), (np.int8, "int8")])
def test_gemm_refuses_dtypes_loom_does_not_know(dtype, name):
    with raises(loom.InvalidArgument, "a has dtype " + name, "bfloat16, float16 or float32"):
        _C.gemm(z(128, 64, dtype=dtype), z(64, 32), z(128, 32), 0)


def test_gemm_torch_dtype_error_names_the_torch_dtype():
    with raises(loom.InvalidArgument, "b has dtype torch.int64"):
        _C.gemm(t(128, 64), torch.zeros(64, 32, dtype=torch.int64), t(128, 32), 0)


def test_gemm_fp32_inputs_are_unsupported():
    with raises(loom.Unsupported, "a is fp32", "bf16 or fp16"):
        _C.gemm(z(128, 64, dtype=np.float32), z(64, 32, dtype=np.float32), z(128, 32, dtype=np.float32), 0)


def test_gemm_mixed_input_dtypes():
    with raises(loom.InvalidArgument, "a is bf16 but b is fp16"):
        _C.gemm(t(128, 64), t(64, 32, dtype=torch.float16), t(128, 32), 0)


@pytest.mark.parametrize("layout,b_shape", [("kn", (63, 32)), ("nk", (32, 63)), ("nk", (64, 32))])
def test_gemm_inner_dimension_mismatch(layout, b_shape):
    with raises(loom.InvalidArgument, "a is [128, 64] (K = 64) but b is [" + ", ".join(map(str, b_shape))):
        _C.gemm(z(128, 64), z(*b_shape), z(128, 32), 0, layout)


def test_gemm_wrong_output_shape():
    with raises(loom.InvalidArgument, "out must be [M, N] = [128, 32], got [128, 33]"):
        _C.gemm(z(128, 64), z(64, 32), z(128, 33), 0)


def test_gemm_needs_matrices():
    with raises(loom.InvalidArgument, "a must be 2-D [M, K], got shape [128]"):
        _C.gemm(z(128), z(64, 32), z(128, 32), 0)


def test_gemm_non_contiguous():
    with raises(loom.InvalidArgument, "a [128, 64] is not row-major contiguous"):
        _C.gemm(z(64, 128).T, z(64, 32), z(128, 32), 0)
    with raises(loom.InvalidArgument, "b [64, 32] is not row-major contiguous"):
        _C.gemm(t(128, 64), t(32, 64).t(), t(128, 32), 0)


def test_gemm_not_a_tensor():
    with raises(loom.InvalidArgument, "a must be a tensor", "list"):
        _C.gemm([[1.0]], z(64, 32), z(128, 32), 0)
    with raises(loom.InvalidArgument, "out is None"):
        _C.gemm(z(128, 64), z(64, 32), None, 0)


def test_gemm_bad_options():
    with raises(loom.InvalidArgument, "b_layout 'mk'"):
        _C.gemm(z(128, 64), z(64, 32), z(128, 32), 0, "mk")
    with raises(loom.InvalidArgument, "tile '99x99'"):
        _C.gemm(z(128, 64), z(64, 32), z(128, 32), 0, "kn", "99x99")


def test_gemm_python_layer_reports_the_device_not_the_stream():
    # numpy has no CUDA stream: the Python layer must let the op refuse the CPU array.
    with raises(loom.InvalidArgument, "a is on cpu"):
        loom.gemm(z(128, 64), z(64, 32), z(128, 32))


def test_unknown_cuda_framework_must_pass_a_stream():
    class CudaArray:
        def __dlpack_device__(self):
            return (2, 0)

    with raises(loom.InvalidArgument, "pass stream="):
        loom.gemm(CudaArray(), z(64, 32), z(128, 32))


# ---- collectives ------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce"])
def test_collective_correct_shapes_fail_only_on_the_device(op):
    send, recv = {"all_gather": ((4, 8), (8, 8)), "reduce_scatter": ((8, 8), (4, 8)),
                  "all_reduce": ((4, 8), (32,))}[op]
    with raises(loom.InvalidArgument, f"loom rank 0: {op}: send is on cpu"):
        _C._check_args(op, 2, (z(*send), z(*recv)))


def test_all_gather_recv_size():
    with raises(loom.InvalidArgument, "recv [4, 8] must hold world_size (2) x send [4, 8] = 64 elements, it holds 32"):
        _C._check_args("all_gather", 2, (z(4, 8), z(4, 8)))


def test_reduce_scatter_send_size():
    with raises(loom.InvalidArgument, "send [8, 8] must hold world_size (4) x recv [4, 8] = 128 elements"):
        _C._check_args("reduce_scatter", 4, (z(8, 8), z(4, 8)))


def test_all_reduce_sizes_and_dtypes():
    with raises(loom.InvalidArgument, "must hold the same number of elements"):
        _C._check_args("all_reduce", 2, (z(4, 8), z(4, 9)))
    with raises(loom.InvalidArgument, "send is bf16 but recv is fp32"):
        _C._check_args("all_reduce", 2, (t(4, 8), t(4, 8, dtype=torch.float32)))


def test_collectives_accept_fp32():
    # fp32 is a collective dtype: the call gets as far as the device check.
    with raises(loom.InvalidArgument, "send is on cpu"):
        _C._check_args("all_reduce", 2, (z(4, 8, dtype=np.float32), z(4, 8, dtype=np.float32)))


# ---- tensor-parallel GEMMs --------------------------------------------------------------------

@pytest.mark.parametrize("op,a,b,out", [
    ("ag_gemm", (64, 32), (32, 16), (128, 16)),
    ("gemm_rs", (128, 32), (32, 16), (64, 16)),
    ("gemm_ar", (128, 32), (32, 16), (128, 16)),
])
def test_tp_correct_shapes_fail_only_on_the_device(op, a, b, out):
    with raises(loom.InvalidArgument, f"{op}: a is on cpu"):
        _C._check_args(op, 2, (z(*a), z(*b), z(*out)))


def test_ag_gemm_out_is_the_gathered_rows():
    with raises(loom.InvalidArgument, "out must be [M, N] = [128, 16], got [64, 16]"):
        _C._check_args("ag_gemm", 2, (z(64, 32), z(32, 16), z(64, 16)))


def test_gemm_rs_rows_must_divide():
    with raises(loom.InvalidArgument, "M = 127 rows of a [127, 32] do not divide by the world size 2"):
        _C._check_args("gemm_rs", 2, (z(127, 32), z(32, 16), z(63, 16)))
    with raises(loom.InvalidArgument, "out must be [M/W, N] = [32, 16], got [64, 16]"):
        _C._check_args("gemm_rs", 4, (z(128, 32), z(32, 16), z(64, 16)))


def test_tp_nn_linear_layout():
    with raises(loom.InvalidArgument, "gemm_ar: a is on cpu"):
        _C._check_args("gemm_ar", 2, (z(128, 32), z(16, 32), z(128, 16)), "nk")
    with raises(loom.InvalidArgument, "b_layout 'nk'"):
        _C._check_args("gemm_ar", 2, (z(128, 32), z(32, 16), z(128, 16)), "nk")


def test_tp_fp32_is_unsupported_and_dtypes_must_match():
    f32 = np.float32
    with raises(loom.Unsupported, "ag_gemm: a is fp32"):
        _C._check_args("ag_gemm", 2, (z(64, 32, dtype=f32), z(32, 16, dtype=f32), z(128, 16, dtype=f32)))
    with raises(loom.InvalidArgument, "a is bf16 but out is fp16"):
        _C._check_args("gemm_rs", 2, (t(128, 32), t(32, 16), t(64, 16, dtype=torch.float16)))


def test_gathered_a_shape_and_owner():
    with raises(loom.InvalidArgument, "gathered_a must be [M, K] = [128, 32], got [64, 32]"):
        _C._check_args("ag_gemm", 2, (z(64, 32), z(32, 16), z(128, 16), z(64, 32)))
    with raises(loom.InvalidArgument, "gathered_a belongs to ag_gemm"):
        _C._check_args("gemm_rs", 2, (z(128, 32), z(32, 16), z(64, 16), z(128, 32)))


def test_unknown_op():
    with raises(loom.InvalidArgument, "unknown op 'gemm2'"):
        _C._check_args("gemm2", 2, ())
