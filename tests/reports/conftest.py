"""Session fixtures: one real tiny ablation (2 variants x 2 seeds) and one real 3-trial search."""

from __future__ import annotations

import pytest

# a made-up published row on the studies' split: the reports print it beside the best trial / the baseline
PUBLISHED = {"published.source": "a made-up table", "published.split": "val", "published.r1": 1.0,
             "published.r5": 2.0, "published.r10": 3.0, "published.r100": 50.0, "published.sumr": 56.0}


@pytest.fixture(scope="session")
def studies(tiny_root, tmp_path_factory):
    """{"tmp", "uri", "ablation": parent id, "search": parent id} of real studies run through the platform."""
    import ray

    from prvrlab.platform.search.ablation import ablate
    from prvrlab.platform.search.tuning import search
    from prvrlab.platform.search.spec import load_ablation_spec, load_search_spec
    from search_helpers import tiny_spec

    tmp = tmp_path_factory.mktemp("report_studies")
    variants = {"full": {}, "no_query_diverse": {"losses.query_diverse.weight": 0}}
    abl_path = tiny_spec(tmp, tiny_root, name="abl", overrides=PUBLISHED, variants=variants, seeds=[0, 1], concurrency=2)
    abl = ablate(load_ablation_spec(abl_path), echo=None)
    srch = search(load_search_spec(tiny_spec(tmp, tiny_root, name="srch", overrides=PUBLISHED)), echo=None)
    ray.shutdown()
    return {
        "tmp": tmp,
        "uri": f"sqlite:///{tmp / 'mlflow.db'}",
        "ablation": abl.parent_run_id,
        "search": srch.parent_run_id,
        "ablation_spec": abl_path,
    }
