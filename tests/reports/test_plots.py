"""The report's figures: titles, labels, legends, integer epochs, table-consistent means."""

import pytest

from prvrlab.reports import plots


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions close, kept for inspection."""
    kept, close = [], plots.plt.close
    monkeypatch.setattr(plots.plt, "close", kept.append)
    yield kept
    for fig in kept:
        close(fig)


def test_learning_curves_have_title_legend_and_integer_epochs(tmp_path, figures):
    plots.learning_curves([("t0 (1.0)", [(1, 1.0), (2, 2.0)]), ("t1 (0.5)", [(1, 0.5), (2, 0.7)])], tmp_path / "c.png",
                          ylabel="val/sumr")
    ax = figures[0].axes[0]
    assert ax.get_title() and ax.get_xlabel() == "epoch" and ax.get_ylabel() == "val/sumr"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["t0 (1.0)", "t1 (0.5)"]
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 2]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert list(ax.get_lines()[0].get_xdata()) == [1, 2]  # epochs count from 1, drawn as given


def test_sensitivity_line_goes_through_the_given_bin_means(tmp_path, figures):
    points = [(1e-4, 10.0), (1.2e-4, 20.0), (1e-2, 40.0)]
    means = [(1.1e-4, 15.0), (1e-2, 40.0)]
    plots.sensitivity_plot("train.lr", points, tmp_path / "s.png", means=means, binned=True, log=True)
    ax = figures[0].axes[0]
    assert ax.get_title() and ax.get_ylabel() == "SumR" and ax.get_xlabel().startswith("train.lr")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["one run", "mean per bin (table)"]
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [1.1e-4, 1e-2] and list(line.get_ydata()) == [15.0, 40.0]


def test_categorical_sensitivity_defaults_to_the_mean_per_value(tmp_path, figures):
    plots.sensitivity_plot("model.pool", [("avg", 1.0), ("avg", 3.0), ("max", 5.0)], tmp_path / "c.png", categorical=True)
    ax = figures[0].axes[0]
    (line,) = ax.get_lines()
    assert list(line.get_ydata()) == [2.0, 5.0]
    assert "mean per value (table)" in [t.get_text() for t in ax.get_legend().get_texts()]
