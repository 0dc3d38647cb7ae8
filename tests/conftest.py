import pytest

# The tests `make test-newest` runs (marked `newest` here), a test file's test function (all its
# parameters) or one parametrized case: under the pinned Triton they run every line of scan_lib that
# the kernels' test files it draws from run (those the Makefile does not --ignore: every kernel and
# host function, each branch the files take, measured per test with coverage.py), in about 15% of the
# files' time (88 s of 583 s summed here). Picked greedily, most new lines per second first, a single
# case only where its function's other cases add nothing; the function as a whole where it is cheap
# (its bad-input cases, say). A test added for a new kernel or branch joins it; a name here that no
# longer exists stops `make test-newest` with the name.
NEWEST = (
    # tests/test_causal_conv1d.py
    'tests/test_causal_conv1d.py::test_bad_input',
    'tests/test_causal_conv1d.py::test_check_catches_an_injected_off_by_one',
    'tests/test_causal_conv1d.py::test_empty_x_gives_an_empty_result',
    'tests/test_causal_conv1d.py::test_final_states_out_and_return_types',
    'tests/test_causal_conv1d.py::test_gradcheck',
    'tests/test_causal_conv1d.py::test_matches_reference[2-1]',
    'tests/test_causal_conv1d.py::test_offsets_past_32_bits_are_refused',
    'tests/test_causal_conv1d.py::test_second_derivative_raises',
    'tests/test_causal_conv1d.py::test_seq_idx_bad_input',
    'tests/test_causal_conv1d.py::test_seq_idx_compares_ids_as_the_package_does',
    'tests/test_causal_conv1d.py::test_seq_idx_matches_the_cut_rows[one sequence-2]',
    'tests/test_causal_conv1d.py::test_seq_idx_under_compile',
    'tests/test_causal_conv1d.py::test_update_half_precision_and_bad_input',
    'tests/test_causal_conv1d.py::test_update_steps_equal_one_call',
    'tests/test_causal_conv1d.py::test_update_takes_several_positions_as_the_package_does',
    'tests/test_causal_conv1d.py::test_update_under_compile',
    'tests/test_causal_conv1d.py::test_update_with_no_positions_still_checks_its_inputs',
    'tests/test_causal_conv1d.py::test_vmap_matches_a_loop',
    'tests/test_causal_conv1d.py::test_weight_in_another_dtype',
    # tests/test_cumsum.py
    'tests/test_cumsum.py::test_as_columns_needs_one_stride_on_each_side',
    'tests/test_cumsum.py::test_awkward_lengths_through_many_blocks',
    'tests/test_cumsum.py::test_bad_input',
    'tests/test_cumsum.py::test_check_catches_a_skipped_carry',
    'tests/test_cumsum.py::test_column_scan_reads_in_place_with_no_copy[0]',
    'tests/test_cumsum.py::test_copy_path_copies_back_only_where_the_result_is_not_rows[shape0-1-1]',
    'tests/test_cumsum.py::test_config_switches_the_public_function',
    'tests/test_cumsum.py::test_default_blocks_on_long_rows',
    'tests/test_cumsum.py::test_dtype_argument_casts_first_like_torch',
    'tests/test_cumsum.py::test_fake_tensor_gives_shape_and_dtype',
    'tests/test_cumsum.py::test_random_shapes_dims_dtypes[0-dtype0]',
    'tests/test_cumsum.py::test_result_is_not_a_view_of_the_input',
    'tests/test_cumsum.py::test_threshold_picks_the_path',
    'tests/test_cumsum.py::test_torch_func_grad_and_vmap',
    'tests/test_cumsum.py::test_zero_dim_tensor_gives_a_copy_like_torch',
    # tests/test_ema.py
    'tests/test_ema.py::test_error_bound_is_per_element_and_by_dtype',
    'tests/test_ema.py::test_kernel_within_bound',
    'tests/test_ema.py::test_non_associative_combine_is_caught',
    'tests/test_ema.py::test_skipped_carry_fails_the_check',
    # tests/test_flash_attention.py
    'tests/test_flash_attention.py::test_bad_input',
    'tests/test_flash_attention.py::test_double_backward_is_refused_not_wrong',
    'tests/test_flash_attention.py::test_empty',
    'tests/test_flash_attention.py::test_every_gradient',
    'tests/test_flash_attention.py::test_fake_tensor_gives_shapes_and_dtypes',
    'tests/test_flash_attention.py::test_forward_and_lse',
    'tests/test_flash_attention.py::test_func_grad',
    'tests/test_flash_attention.py::test_padding_reads_and_writes_nothing_outside_the_head_dim',
    'tests/test_flash_attention.py::test_vmap_and_vmap_of_grad',
    # tests/test_host_path.py
    'tests/test_host_path.py::test_an_empty_call_stays_within_its_budget_of_calls',
    # tests/test_linear_scan.py
    'tests/test_linear_scan.py::test_bad_input',
    'tests/test_linear_scan.py::test_both_ways_of_scanning_against_memory_order',
    'tests/test_linear_scan.py::test_compile_fullgraph',
    'tests/test_linear_scan.py::test_every_gradient_float64[False-1-16]',
    'tests/test_linear_scan.py::test_second_derivative_with_allow_unused',
    'tests/test_linear_scan.py::test_second_derivatives_through_torch_func_reverse_mode_only',
    'tests/test_linear_scan.py::test_zero_dim_gate_does_not_promote_tokens',
    'tests/test_linear_scan.py::test_zero_dim_initial_state_of_a_single_row',
    # tests/test_mamba2.py: the gated norm's kernels only (the block, built on the kernels, is left out as
    # test_mamba.py is)
    'tests/test_mamba2.py::test_fused_norm_gradcheck_and_second_derivatives',
    'tests/test_mamba2.py::test_fused_norm_matches_the_pytorch_form[rows_shape1-24-24-no_z-fp32]',
    # tests/test_multistate.py
    'tests/test_multistate.py::test_bad_input_names_the_argument',
    'tests/test_multistate.py::test_compile_fullgraph_forward_and_backward',
    'tests/test_multistate.py::test_every_gradient_matches_autograd_in_float64[1-16]',
    'tests/test_multistate.py::test_gradient_through_the_last_state_only',
    'tests/test_multistate.py::test_random_shapes_and_dtypes',
    'tests/test_multistate.py::test_reference_check_catches_coupled_states',
    'tests/test_multistate.py::test_second_derivatives_raise',
    'tests/test_multistate.py::test_vmap_matches_a_loop',
    # tests/test_runtime.py
    'tests/test_runtime.py::test_calls_that_need_the_dispatcher_go_through_it',
    'tests/test_runtime.py::test_figures_go_where_scan_course_figures_says',
    'tests/test_runtime.py::test_gpu_assembly_shows_the_layout_and_the_fast_exp',
    'tests/test_runtime.py::test_only_none_rejected_naming_the_arguments',
    'tests/test_runtime.py::test_parameters_and_keywords_keep_the_fast_path',
    'tests/test_runtime.py::test_rounding_check_catches_a_truncating_cast',
    # tests/test_selective_scan.py
    'tests/test_selective_scan.py::test_bad_input',
    'tests/test_selective_scan.py::test_block_never_straddles_a_group',
    'tests/test_selective_scan.py::test_compile_fullgraph',
    'tests/test_selective_scan.py::test_empty_u_gives_an_empty_result',
    'tests/test_selective_scan.py::test_fake_tensors_give_shapes',
    'tests/test_selective_scan.py::test_fast_caches_are_bounded_and_skip_symbolic_keys',
    'tests/test_selective_scan.py::test_fast_forward_refuses_a_save_chunk_that_does_not_divide_its_chunk',
    'tests/test_selective_scan.py::test_fast_launcher_reuses_a_compiled_kernel_only_for_its_alignment_and_device',
    'tests/test_selective_scan.py::test_fast_outputs_and_gradients_take_u_layout[dtype0]',
    'tests/test_selective_scan.py::test_fast_reads_views_in_place[dtype1]',
    'tests/test_selective_scan.py::test_fast_split_into_segments[2-case0]',
    'tests/test_selective_scan.py::test_fast_split_into_segments[50-case3]',
    'tests/test_selective_scan.py::test_fast_split_into_segments[7-case2]',
    'tests/test_selective_scan.py::test_gradient_of_one_input_through_the_last_state_only',
    'tests/test_selective_scan.py::test_hessian_raises',
    'tests/test_selective_scan.py::test_matches_reference[05-2-4-3-1-options0]',
    'tests/test_selective_scan.py::test_matches_reference[07-2-4-3-1-options0]',
    'tests/test_selective_scan.py::test_sizes_past_32_bit_offsets_are_refused',
    'tests/test_selective_scan.py::test_states_per_step',
    # tests/test_ssd.py
    'tests/test_ssd.py::test_chunked_and_matrix_forms_match_the_loop',
    'tests/test_ssd.py::test_mamba_chunk_scan_combined_compiles_fullgraph',
    'tests/test_ssd.py::test_mamba_chunk_scan_combined_has_no_silent_second_derivative',
    'tests/test_ssd.py::test_mamba_chunk_scan_combined_matches_autograd_through_the_chunked_form[37-16-4-2-3-5-D z bias softplus h0-bfloat16]',
    'tests/test_ssd.py::test_mamba_chunk_scan_combined_names_a_bad_argument',
    'tests/test_ssd.py::test_mamba_chunk_scan_combined_of_an_empty_sequence_is_differentiable',
    'tests/test_ssd.py::test_the_chunked_backward_matches_autograd_through_the_loop',
    'tests/test_ssd.py::test_the_chunked_backward_of_an_empty_sequence',
    'tests/test_ssd.py::test_the_triton_backward_matches_the_chunked_backward[37-16-4-2-3-5-D h0 dfinal]',
    'tests/test_ssd.py::test_the_triton_backward_of_an_empty_sequence',
    'tests/test_ssd.py::test_the_triton_forward_matches_the_loop',
    'tests/test_ssd.py::test_the_triton_forward_names_a_bad_argument',
    'tests/test_ssd.py::test_the_triton_forward_refuses_float64_and_gradients_it_cannot_give',
    'tests/test_ssd.py::test_the_triton_forward_refuses_groups_that_do_not_divide_heads',
    'tests/test_ssd.py::test_the_walk_over_the_chunks_matches_the_chunked_form[70-32-2-1-80-16-z h0-dtype0-0.03]',
    'tests/test_ssd.py::test_the_walk_falls_back_to_section_5s_kernels_where_the_gpu_refuses_it',
)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a grading run of one chapter's untouched or partly solved exercise notebook on "
        "Triton's interpreter (tens of seconds each); `make test-slow` runs them, `make test` (CI) does not: "
        "it grades chapter 02's notebooks in every state, and every chapter's own solutions. Also a test "
        "whose checks a chapter that make test runs under nbval makes too (its docstring says which)")
    config.addinivalue_line(
        "markers", "newest: one of the tests `make test-newest` runs under the newest Triton and NumPy "
        "(tests/conftest.py's NEWEST gives it)")


@pytest.hookimpl(tryfirst=True)   # before -m deselects by the marks
def pytest_collection_modifyitems(config, items):
    """Marks NEWEST's tests `newest`; a run that selects them (-m newest) fails on a name that matched
    nothing in a test file it collected."""
    wanted, found, files = set(NEWEST), set(), set()
    for item in items:
        files.add(item.nodeid.split("::", 1)[0])
        for name in (item.nodeid, item.nodeid.split("[", 1)[0]):
            if name in wanted:
                item.add_marker(pytest.mark.newest)
                found.add(name)
    missing = sorted(name for name in wanted - found if name.split("::", 1)[0] in files)
    if "newest" in (config.getoption("markexpr") or "") and missing:
        raise pytest.UsageError(f"tests/conftest.py's NEWEST names tests that were not collected: {missing}")


def pytest_addoption(parser):
    parser.addoption(
        "--whole-notebooks", action="store_true",
        help="with -n: hand each notebook's cells (nbval) to one worker as one unit, the notebooks first, "
             "largest first, then the tests one by one (make test runs the tests and the chapters so)")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs the tests and the chapters under nbval in one pytest run, so that neither waits
    for the other's last, longest item with a core idle. A chapter's cells must run in order in one
    kernel, on one worker: this scheduler (xdist's loadscope, largest scope first) takes a notebook as one
    scope and each test as its own. (xdist's --dist loadgroup would do it with marks, but with pytest 9.2
    and xdist 3.8 it does not group: it renames items through an attribute pytest no longer reads.)"""
    if not config.getoption("whole_notebooks"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WholeNotebooks(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return path if path.endswith(".ipynb") else nodeid

    return WholeNotebooks(config, log)


@pytest.fixture(scope="module")
def one_cpu_thread():
    """For modules of tiny tensors (`pytestmark = pytest.mark.usefixtures("one_cpu_thread")`): the time goes to
    Python and the interpreter, and several intra-op threads on a shared CPU only wait for each other (a
    1000-step loop took 100x longer with them). Restored afterwards."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_tf32():
    """Full float32 in cuBLAS and cuDNN (mamba_ssm's unfused paths and PyTorch's F.conv1d may run TF32 on a GPU,
    where cuDNN allows it by default). Set by hand: pytest's monkeypatch cannot restore these flags (torch
    implements them in __setattr__)."""
    import torch
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
