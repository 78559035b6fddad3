"""A visual feature store or a collection that is not there is named with what is: the stores under
FeatureData/ (and the closest), the collections TextData/ holds captions of (and the closest)."""

from __future__ import annotations

import shutil

import pytest

from prvrlab.data.collection import caption_collections, open_collection
from prvrlab.data.config import DataConfig
from prvrlab.data.errors import DataError


def test_a_misspelled_visual_store_names_the_stores_there(tiny_root):
    with pytest.raises(DataError) as caught:
        open_collection(DataConfig(root=str(tiny_root), collection="synth", visual_feature="synth_fet"))
    assert str(caught.value) == (f"visual features not found: {tiny_root / 'FeatureData' / 'synth_fet'} "
                                 "(did you mean 'synth_feat'?); stores in FeatureData/: synth_feat")


def test_a_misspelled_collection_names_the_collections_with_captions(tiny_root):
    with pytest.raises(DataError) as caught:
        open_collection(DataConfig(root=str(tiny_root), collection="synht", visual_feature="synth_feat"))
    text = tiny_root / "TextData"
    assert str(caught.value) == (f"query features file not found: {text / 'roberta_synht_query_feat.hdf5'}; {text} holds "
                                 "captions of collection 'synth', not 'synht' (did you mean 'synth'?)")


def test_a_collection_with_captions_but_no_query_file_keeps_the_plain_message(tiny_root, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(tiny_root, root)
    (root / "TextData" / "roberta_synth_query_feat.hdf5").unlink()
    with pytest.raises(DataError, match=r"^query features file not found: .*roberta_synth_query_feat\.hdf5$"):
        open_collection(DataConfig(root=str(root), collection="synth", visual_feature="synth_feat"))


def test_caption_collections_strips_only_a_split_name(tmp_path):
    for name in ("tvrtrain", "tvrval", "actnettest", "test", "notes"):
        (tmp_path / f"{name}.caption.txt").write_text("")
    assert caption_collections(tmp_path) == ["actnet", "tvr"]
    assert caption_collections(tmp_path / "none") == []
