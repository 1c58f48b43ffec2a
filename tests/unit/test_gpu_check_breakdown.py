"""bench/gpu_check's step breakdown (bench/gpu_check/breakdown.py) on names and intervals made up here: no
profiler, no torch. The dry run profiles real CPU steps (tests/runs/launch/test_gpu_check.py)."""

from __future__ import annotations

import pytest

from bench.gpu_check.breakdown import GAPS, bucket, describe, summarize

# Kernel names as CUDA traces of torch 2.11 on an H100 spell them (cuBLAS / CUTLASS GEMMs, FlashAttention, inductor's
# fused Triton kernels, ATen's own), and aten op names as the CPU profile has them.
NAMES = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off": "gemm",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_64x1_tn_align8>": "gemm",
    "aten::mm": "gemm",
    "aten::_scaled_mm": "gemm",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>": "attention",
    "triton_tem_fused_flex_attention_0": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norm",
    "triton_red_fused__log_softmax__to_copy_1": "loss",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous": "loss",
    "aten::_log_softmax_backward_data": "loss",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::Tensor": "optimizer",
    "void at::native::(anonymous namespace)::fused_adamw_kernel<float>": "optimizer",
    "aten::_foreach_lerp_": "optimizer",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)": "cast/copy",
    "Memcpy HtoD (Pageable -> Device)": "cast/copy",
    "aten::_to_copy": "cast/copy",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collective",
    "triton_poi_fused_mul_silu_2": "fused (compiled)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": "other",
    "aten::mul": "other",
}


@pytest.mark.parametrize("name", NAMES)
def test_each_kernel_lands_in_its_bucket(name):
    assert bucket(name) == NAMES[name]


def test_shares_of_kernels_that_do_not_overlap_add_up_to_100():
    # 2 steps in 100 us of wall time: GEMMs 40 us, attention 20 us, the rest idle
    spans = [("nvjet_gemm_a", 0, 25), ("flash_fwd_kernel", 30, 50), ("nvjet_gemm_b", 60, 75)]
    b = summarize(spans, 100e-6, 2, source="CUDA kernels", union=True)
    assert b["share_pct"] == {"gemm": 40.0, "attention": 20.0, GAPS: 40.0}
    assert b["seconds_per_step"] == {"gemm": 2e-5, "attention": 1e-5, GAPS: 2e-5}
    assert b["step_s"] == 5e-5 and b["steps"] == 2
    assert [t["name"] for t in b["top"]] == ["nvjet_gemm_a", "flash_fwd_kernel", "nvjet_gemm_b"]
    assert describe(b) == "gemm 40%, attention 20%, gaps 40%"


def test_gaps_are_the_time_no_kernel_runs_when_kernels_overlap():
    # two streams: 0-30 and 10-40 overlap, so the device is busy 40 us of 50 whatever the buckets sum to
    spans = [("nvjet_gemm", 0, 30), ("ncclDevKernel_AllGather", 10, 40)]
    b = summarize(spans, 50e-6, 1, source="CUDA kernels", union=True)
    assert b["share_pct"][GAPS] == 20.0 and b["share_pct"]["gemm"] == 60.0 and b["share_pct"]["collective"] == 60.0


def test_cpu_self_times_sum_and_the_rest_is_gaps():
    ops = [("aten::mm", 0.0, 30.0), ("aten::mm", 0.0, 10.0), ("aten::mul", 0.0, 5.0)]  # self times: durations only
    b = summarize(ops, 100e-6, 1, source="aten ops, self CPU time", union=False)
    assert b["share_pct"] == {"gemm": 40.0, "other": 5.0, GAPS: 55.0}
    assert b["top"][0] == {"name": "aten::mm", "bucket": "gemm", "s_per_step": 4e-5}
    assert describe(b) == "gemm 40%, other 5%, gaps 55%"
