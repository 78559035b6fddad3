"""prvrlab/reports/products.py: every matrix product timed with its FLOPs from the shapes, and the summary
and ranking against a roof worked out by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prvrlab.reports.products import ProductStat, ProductTimer, product_flops, product_lines


def test_the_timer_records_each_product_with_its_flops_and_operand_layout():
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    batch_a, batch_b = torch.randn(4, 5, 7), torch.randn(4, 7, 3)
    x, weight, bias = torch.randn(2, 5, 7), torch.randn(3, 7), torch.randn(3)
    with ProductTimer() as timer:
        torch.mm(a, b)
        torch.mm(a, b)
        torch.addmm(torch.zeros(3), a, b)
        torch.bmm(batch_a, batch_b)
        torch.baddbmm(torch.zeros(4, 5, 3), batch_a, batch_b)
        torch.mm(b.t(), a.t())  # (3, 7) @ (7, 5), both operands transposed views
        F.linear(x, weight, bias)  # a product of 10 rows, 7 -> 3, whatever op the CPU dispatches it as
        (a + 1).sum()  # not a product
    stats = timer.stats
    mm = stats[("aten.mm", "(5, 7) float32 x (7, 3) float32")]
    assert mm.calls == 2 and mm.flops == 2 * (2 * 5 * 7 * 3) and mm.seconds > 0
    assert stats[("aten.mm", "(3, 7)T float32 x (7, 5)T float32")].flops == 2 * 3 * 7 * 5
    assert stats[("aten.addmm", "(3,) float32 x (5, 7) float32 x (7, 3) float32")].flops == 2 * 5 * 7 * 3
    assert stats[("aten.bmm", "(4, 5, 7) float32 x (4, 7, 3) float32")].flops == 2 * 4 * 5 * 7 * 3
    assert stats[("aten.baddbmm", "(4, 5, 3) float32 x (4, 5, 7) float32 x (4, 7, 3) float32")].flops == 2 * 4 * 5 * 7 * 3
    linear = [s for (_, operands), s in stats.items() if "(10, 7)" in operands]  # its (2, 5) rows flattened
    assert len(linear) == 1 and linear[0].flops == 2 * 10 * 7 * 3
    assert {op for op, _ in stats} <= {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "mkldnn._linear_pointwise"}
    assert sum(s.calls for s in stats.values()) == 7


@pytest.mark.skipif(not hasattr(torch.ops.mkldnn, "_linear_pointwise"), reason="no oneDNN fused linear in this torch")
def test_the_fused_linears_flops_come_from_its_weight():
    x, weight, bias = torch.randn(6, 4, 8), torch.randn(5, 8), torch.randn(5)
    assert product_flops("mkldnn._linear_pointwise", [x, weight, bias]) == 2 * 24 * 8 * 5


def test_the_summary_and_the_ranking_against_the_roof():
    big = ProductStat("aten.mm", "big", calls=4, seconds=2.0, flops=2e12)  # at the 1,000 GFLOP/s roof: lost 0
    slow = ProductStat("aten.bmm", "slow", calls=2, seconds=1.0, flops=0.2e12)  # 0.8 s lost
    mid = ProductStat("aten.mm", "mid", calls=2, seconds=0.6, flops=0.4e12)  # 0.2 s lost
    lines = product_lines([big, slow, mid], roof_gflops=1000.0, step_seconds=5.0, top=2, steps=2)
    # per step: 1.8 s of products (36% of 5 s), 1,300 GFLOP at 722 GFLOP/s (72%), 1,300 ms at the roof
    assert lines[0].startswith("matrix products: 1800 ms a step (36% of 5.00 s), 1300 GFLOP at 722 GFLOP/s (72% of ")
    assert lines[0].endswith("at the roof they would take 1300 ms")
    assert [line.split()[-1] for line in lines[2:]] == ["slow", "mid"]  # most time lost first, top 2
    assert lines[2].split()[:4] == ["500.0", "400.0", "1", "200"]  # ms/step, lost ms/step, calls/step, GFLOP/s
    with pytest.raises(ValueError, match="roof_gflops"):
        product_lines([big], roof_gflops=0.0, step_seconds=1.0, top=1)


def test_in_place_and_vector_products_are_timed_too():
    a, v, out = torch.randn(6, 4), torch.randn(4), torch.zeros(6, 3)
    with ProductTimer() as timer:
        torch.mv(a, v)
        torch.addmv(torch.zeros(6), a, v)
        out.addmm_(a, torch.randn(4, 3))
    flops = {op: s.flops for (op, _), s in timer.stats.items()}
    assert flops == {"aten.mv": 2 * 6 * 4, "aten.addmv": 2 * 6 * 4, "aten.addmm_": 2 * 6 * 4 * 3}


def test_the_binary_fused_linear_takes_its_weight_third():
    x, other, weight, bias = torch.randn(10, 7), torch.randn(10, 3), torch.randn(3, 7), torch.randn(3)
    assert product_flops("mkldnn._linear_pointwise", [x, other, weight, bias], "binary") == 2 * 10 * 7 * 3
    assert product_flops("mkldnn._linear_pointwise", [x, weight, bias]) == 2 * 10 * 7 * 3


def test_summary_rejects_what_it_cannot_divide_by_and_shows_calls_per_step():
    stat = ProductStat("aten.mm", "odd", calls=3, seconds=0.2, flops=1e9)
    assert product_lines([stat], roof_gflops=100.0, step_seconds=1.0, top=1, steps=2)[2].split()[2] == "1.5"
    for kwargs in ({"step_seconds": 0.0}, {"steps": 0}, {"top": -1}, {"roof_gflops": float("inf")}):
        args = {"roof_gflops": 100.0, "step_seconds": 1.0, "top": 1, "steps": 1, **kwargs}
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            product_lines([stat], **args)
    assert product_lines([], roof_gflops=100.0, step_seconds=1.0, top=3)[0].startswith("matrix products: 0 ms a step")
