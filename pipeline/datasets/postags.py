"""The POS-tag file of stage `postag` (``data/processed/postags.parquet``) as training reads it: per example, which
label positions are target nouns and verbs (the mask of the hard-KD method)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

from pipeline.common.schema import DataError

POSTAG_COLUMNS = ["example_id", "position", "token_id", "word_index", "word", "pos", "is_noun_or_verb"]
# The columns hard KD reads, typed as stage `postag` writes them, never null (word_index, word, pos are off words)
MASK_FIELDS = [
    pa.field("example_id", pa.string()),
    pa.field("position", pa.int32()),
    pa.field("token_id", pa.int64()),
    pa.field("is_noun_or_verb", pa.bool_()),
]


class NounVerbMasks:
    """Per example, which label positions are nouns or verbs: the mask of the noun-verb hard-KD method."""

    def __init__(self, table: pd.DataFrame, source: str = "data/processed/postags.parquet") -> None:
        self.source = source
        self._tags: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # example id -> (its mask, its label token ids)
        table = table.sort_values(["example_id", "position"], kind="stable")
        for eid, g in table.groupby("example_id", sort=False):
            pos = g["position"].to_numpy()
            if not np.array_equal(pos, np.arange(len(pos))):
                raise DataError(f"{source}: example {eid}: positions are not 0..{len(pos) - 1}")
            self._tags[str(eid)] = (g["is_noun_or_verb"].to_numpy(dtype=bool), g["token_id"].to_numpy(dtype=np.int64))

    def batch(self, example_ids: Sequence[str], labels) -> np.ndarray:
        """[B, T] bool mask for a batch's ``labels`` ([B, T] token ids, padded with the negative ignore index of
        ``pipeline.modeling.batching``). Checks that the tagged token ids equal the batch's labels, so a mask can never
        be applied to a differently tokenised target."""
        labels = np.asarray(labels.cpu() if hasattr(labels, "cpu") else labels)
        out = np.zeros(labels.shape, dtype=bool)
        for b, eid in enumerate(example_ids):
            if eid not in self._tags:
                raise DataError(f"{self.source}: example {eid} has no POS tags (postag.datasets excludes it?)")
            mask, ids = self._tags[eid]
            n = int((labels[b] >= 0).sum())  # token ids are never negative; the padding is
            if not np.array_equal(labels[b, :n], ids):  # False for another length too
                raise DataError(
                    f"{self.source}: example {eid}: tagged token ids differ from the training labels "
                    f"(tagged {len(mask)} tokens, batch {n}); re-run the postag stage"
                )
            out[b, :n] = mask
        return out
