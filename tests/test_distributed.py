"""scan_lib.distributed: the sequence-parallel scans and Mamba block, in several processes run as
launch_plan picks (NCCL with a GPU per rank, gloo with the ranks sharing one GPU, or gloo between CPU
processes), against the same problem run whole in one process, at
awkward lengths and uneven shards, every gradient included; and bad input."""
import os
import socket

import pytest
import torch
import torch.distributed as dist

import scan_lib  # first: without a GPU it switches Triton to its interpreter
from scan_lib import distributed
from scan_lib.runtime import DEVICE

TOLERANCE = 1e-5


@pytest.mark.slow
def test_three_ranks_match_one_process():
    """Uneven shards, one of length 1 (shorter than the convolution's reach: its boundary comes from two
    ranks); the chain of sends gives the all-gather's entering states. Slow (`make test-slow`): chapter 09's
    section 5 cell, which make test runs under nbval, makes the same checks at 3 ranks (its block's middle
    shard has length 2, also shorter than the convolution's reach)."""
    cases = [("linear_scan", (5, 1, 7)), ("selective_scan", (7, 1, 5)), ("mamba", (6, 1, 5)), ("chain", (1, 1, 1))]
    errors = distributed.launch(distributed.check_against_one_process, 3, cases)
    for case, (kind, lengths) in enumerate(cases):
        worst = max(per_rank[case] for per_rank in errors)
        assert worst < TOLERANCE, (kind, lengths, worst)


def test_four_ranks_match_one_process():
    """Four ranks: the block's last rank takes its convolution boundary from three ranks (shards of 1 and 1
    before it), whose gradient goes back along the chain of windows, two hops. Chapter 09's cell cannot
    make this case at 3 ranks; its scans' (a length-1 shard, the backward's chain across it) it makes.
    Beside it, in the same launch (starting the ranks is most of the cost), a first shard of length 1."""
    cases = [("mamba", (2, 1, 1, 4)), ("selective_scan", (1, 3, 2, 4))]
    errors = distributed.launch(distributed.check_against_one_process, 4, cases, 5)
    for case, (kind, lengths) in enumerate(cases):
        assert max(per_rank[case] for per_rank in errors) < TOLERANCE, (kind, lengths)


@pytest.mark.slow
def test_four_ranks_scans_match_one_process():
    """The scans at four ranks, uneven shards, one of length 1: the reverse chain of the backward over three
    hops. Slow (`make test-slow`): one hop more than chapter 09's 3-rank cell, the same code."""
    cases = [("linear_scan", (3, 1, 4, 2)), ("selective_scan", (2, 5, 1, 3))]
    errors = distributed.launch(distributed.check_against_one_process, 4, cases, 5)
    for case, (kind, lengths) in enumerate(cases):
        assert max(per_rank[case] for per_rank in errors) < TOLERANCE, (kind, lengths)


@pytest.mark.slow
def test_two_ranks_match_one_process():
    """Cases beside chapter 09's section 5 cell, which make test runs under nbval and which checks linear_scan
    at (64, 65) and selective_scan at (33, 20) on 2 ranks: a first shard of length 1, and the block. Slow
    (`make test-slow`): the 4-rank test has a first shard of length 1 too, and the block at 3 and 4 ranks
    (09's cell, the 4-rank test) takes its boundary through the same code."""
    cases = [("selective_scan", (1, 40)), ("mamba", (5, 6))]
    errors = distributed.launch(distributed.check_against_one_process, 2, cases, 3)
    for case, (kind, lengths) in enumerate(cases):
        assert max(per_rank[case] for per_rank in errors) < TOLERANCE, (kind, lengths)


@pytest.fixture
def one_rank():
    """This process as a group of one (gloo): the sharded functions must then equal the plain ones."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_one_rank_is_the_plain_scan(one_rank):
    g = torch.Generator().manual_seed(0)
    gates, tokens, h0 = torch.rand(2, 9, generator=g), torch.randn(2, 9, generator=g), torch.randn(2, generator=g)
    gates, tokens, h0 = gates.to(DEVICE), tokens.to(DEVICE), h0.to(DEVICE)
    torch.testing.assert_close(distributed.linear_scan(gates, tokens, h0), scan_lib.linear_scan(gates, tokens, h0))


def test_bad_input(one_rank):
    with pytest.raises(ValueError, match="tokens must hold at least one position"):
        distributed.linear_scan(torch.rand(2, 0, device=DEVICE), torch.rand(2, 0, device=DEVICE))
    with pytest.raises(ValueError, match="u must hold at least one position"):
        empty = torch.rand(1, 2, 0, device=DEVICE)
        distributed.selective_scan(empty, empty, -torch.rand(2, 3, device=DEVICE), torch.rand(1, 3, 0, device=DEVICE),
                                   torch.rand(1, 3, 0, device=DEVICE))
    u, grouped = torch.rand(1, 2, 4, device=DEVICE), torch.rand(1, 2, 3, 4, device=DEVICE)   # 2 groups of B
    with pytest.raises(ValueError, match="B: the all-to-all here takes one group per position"):
        distributed.selective_scan_all_to_all(u, u, -torch.rand(2, 3, device=DEVICE), grouped, grouped)


def test_an_empty_shard_raises_on_every_rank():
    """The block's convolution boundary gathers every shard's length first, so every rank raises (none
    waits for an exchange the empty rank never joins); the all-to-all checks that the shards are equal."""
    with pytest.raises(Exception, match="rank 1's is empty"):
        distributed.launch(distributed.check_against_one_process, 2, [("mamba", (3, 0))])


def test_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.linear_scan(torch.rand(2, 4, device=DEVICE), torch.rand(2, 4, device=DEVICE))


@pytest.mark.slow
def test_the_backward_receives_one_summary_per_rank_whatever_the_ranks():
    """The backward's exchanges are reverse chains: each rank but the last receives one summary (batch x
    channels x N float32) and, in the block, one convolution window (batch x d_inner x (d_conv - 1)),
    at 2, 3 and 4 ranks alike, each rank holding the same shard; the forward's all-gathers receive a
    summary of 2 states (and the block's window and its int64 length) from each other rank. The same
    launches count chapter 09's other designs (the chain, the all-to-all), which must equal the cost
    model's bytes, the all-to-all computing the same scan.

    Slow (`make test-slow`, about 2 minutes of CPU here): CI runs the same check in the chapter,
    notebooks/09_multi_gpu.ipynb under nbval (`make test`): the bytes cell of its "Going deeper: the
    exchange, timed and counted" launches the same bytes_per_pass at 2, 3 and 4 ranks and asserts these
    forward and backward counts on every rank and the 1.5x bound, and the first cell after the export
    in its "Going deeper: how real systems split a sequence" asserts, on those launches, every design's
    counts against exchange_costs(ranks, 1, ranks, 4, 4 * ranks, activation_bytes=4) and the
    all-to-all's difference below 1e-5. A change to either copy of these assertions belongs in both."""
    summary = {"selective_scan": 1 * 4 * 4 * 4, "mamba": 1 * 8 * 4 * 4}   # bytes_per_pass's batch, dim (d_inner 8), N
    window = 1 * 8 * 3 * 4
    backward = {"selective_scan": summary["selective_scan"], "mamba": summary["mamba"] + window}
    forward = {"selective_scan": 2 * summary["selective_scan"], "mamba": 2 * summary["mamba"] + window + 8}
    most = {kind: [] for kind in summary}
    for ranks in (2, 3, 4):
        per_rank = distributed.launch(distributed.bytes_per_pass, ranks)
        for kind in summary:
            assert [r[kind]["backward"] for r in per_rank] == [backward[kind]] * (ranks - 1) + [0], (ranks, kind, per_rank)
            assert all(r[kind]["forward"] == forward[kind] * (ranks - 1) for r in per_rank), (ranks, kind, per_rank)
            most[kind].append(max(r[kind]["backward"] for r in per_rank))
        model = distributed.exchange_costs(ranks, 1, ranks, 4, 4 * ranks, activation_bytes=4)   # bytes_by_design's shape
        for design, counts in per_rank[0]["designs"]["counts"].items():
            for i, predicted in enumerate(model[design]["received"]):
                if counts[i] is not None:
                    assert max(r["designs"]["counts"][design][i] for r in per_rank) == predicted, (ranks, design, i)
        assert max(r["designs"]["difference"] for r in per_rank) < TOLERANCE
    for kind, counts in most.items():   # what issue 25 asks: within 1.5x of each other at 2, 3 and 4 ranks
        assert max(counts) <= 1.5 * min(counts), (kind, counts)
