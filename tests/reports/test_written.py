"""What ``prvrlab report`` says about what it wrote and how far to trust it."""

from prvrlab.reports.report import figures_of, written_text


def test_written_text_counts_the_linked_figures(tmp_path):
    md = tmp_path / "report.md"
    md.write_text("# x\n\nno figures here\n")
    assert written_text(md) == f"{md} and no figure"
    md.write_text("![SumR against lr](sensitivity_lr.png)\n")
    assert written_text(md) == f"{md} and 1 figure"
    md.write_text("![a](learning_curves.png)\n\ntext\n\n![b](sensitivity_x.png)\n![c](component_y.png)\n")
    assert figures_of(md) == ["learning_curves.png", "sensitivity_x.png", "component_y.png"]
    assert written_text(md) == f"{md} and 3 figures"


def test_importances_from_few_trials_carry_a_caveat():
    from prvrlab.reports.report import FEW_TRIALS, importance_caveat

    assert importance_caveat(3) == " **Based on 3 trials only; treat as indicative.**"
    assert "1 trial only" in importance_caveat(1)
    assert importance_caveat(FEW_TRIALS) == ""


def test_saturated_r100_gets_a_note():
    from prvrlab.reports.report import saturation_note

    assert "saturated on this gallery size" in saturation_note([100.0, 99.96, None])
    assert saturation_note([100.0, 98.0]) == "" and saturation_note([None]) == ""
