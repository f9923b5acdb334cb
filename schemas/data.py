"""What the controller's data preparation produced (``trainer.builtin.prepare``), handed to the ranks in the seam,
and the part of it recorded in every checkpoint's manifest (``DataRecord``) so a resume never trains on
other data than the run started with. No torch, no prefect."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PreparedSplit(_Frozen):
    """One tokenized split in the data cache: a flat token file (+ a target mask for chat data)."""

    key: str = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 content key: dataset files, tokenizer files, settings; the cache entry's name",
    )
    dataset: str = Field(description="data.dataset as given (path or Hub id)")
    split: str = Field(description="the split tokenized, e.g. 'train' or 'train[:95%]'")
    tokenizer: str = Field(description="the tokenizer's folder or Hub id as given")
    dataset_sha256: str = Field(
        description="sha256 over the files of the split (name + sha256 of each; in a folder "
        "with split names, only that split's files); for a Hub dataset, of the datasets "
        "library's fingerprint of the split"
    )
    tokenizer_sha256: str = Field(description="sha256 over the tokenizer's files (name + sha256 of each)")
    settings: dict[str, Any] = Field(description="what else decides the tokens: format, column, split, EOS policy")
    path: str = Field(description="absolute path of the token file (raw little-endian ids of dtype)")
    mask_path: str | None = Field(
        None,
        description="format chat: uint8 file, 1 where the token is a training "
        "target (assistant turns); None for text (every token is a target)",
    )
    dtype: Literal["uint16", "uint32"] = Field(description="element type of the token file")
    tokens: int = Field(ge=0, description="tokens in the file")
    rows: int = Field(ge=0, description="dataset rows (documents or conversations) tokenized")
    targets: int = Field(ge=0, description="tokens that are training targets (= tokens for text)")
    max_id: int = Field(ge=-1, description="largest token id in the file (-1 when empty)")
    vocab_size: int = Field(ge=1, description="len(tokenizer), added tokens included")
    seconds: float = Field(0.0, ge=0, description="time the tokenization took (0 for a cache hit)")
    cached: bool = Field(False, description="found in the cache (not tokenized now)")
    compat_keys: list[str] = Field(
        default_factory=list,
        description="keys the same content had under the earlier "
        "rule that hashed every file of a dataset folder, eval files included: a checkpoint "
        "recorded with one was trained on this data",
    )

    def record(self) -> DataRecord:
        return DataRecord(
            key=self.key,
            dataset=self.dataset,
            split=self.split,
            tokenizer=self.tokenizer,
            dataset_sha256=self.dataset_sha256,
            tokenizer_sha256=self.tokenizer_sha256,
            settings=self.settings,
            tokens=self.tokens,
            compat_keys=self.compat_keys,
        )


class PreparedData(_Frozen):
    """The splits a segment trains and evaluates on (what ``SegmentLaunch.data`` carries to the ranks)."""

    train: PreparedSplit
    eval: PreparedSplit | None = None

    def record(self) -> DataRecord:
        return self.train.record().model_copy(update={"eval_key": self.eval.key if self.eval else None})


class DataRecord(_Frozen):
    """The data a checkpoint was trained on (CheckpointManifest.data): a resume refuses any other."""

    key: str = Field(description="content key of the training split (PreparedSplit.key)")
    dataset: str = Field(description="data.dataset as given")
    split: str = Field(description="training split")
    tokenizer: str = Field(description="tokenizer folder or Hub id as given")
    dataset_sha256: str = Field(description="sha256 over the dataset's files")
    tokenizer_sha256: str = Field(description="sha256 over the tokenizer's files")
    settings: dict[str, Any] = Field(description="format, column, split, EOS policy")
    tokens: int = Field(ge=0, description="tokens in the training split")
    eval_key: str | None = Field(None, description="content key of the held-out split, when evaluated")
    compat_keys: list[str] = Field(
        default_factory=list,
        description="earlier-rule keys of the same training data "
        "(PreparedSplit.compat_keys); a resume accepts a checkpoint recorded with one",
    )


def data_change(old: DataRecord, new: DataRecord) -> str | None:
    """What differs between the data a checkpoint was trained on and the data prepared now, in words;
    None when it is the same data (same content key)."""
    if old.key == new.key or old.key in new.compat_keys:
        return None
    if old.dataset_sha256 != new.dataset_sha256:
        return (
            f"the dataset's files changed (data.dataset {new.dataset}: sha256 {old.dataset_sha256[:12]} at save, "
            f"{new.dataset_sha256[:12]} now)"
        )
    if old.tokenizer_sha256 != new.tokenizer_sha256:
        return (
            f"the tokenizer's files changed ({new.tokenizer}: sha256 {old.tokenizer_sha256[:12]} at save, "
            f"{new.tokenizer_sha256[:12]} now)"
        )
    diff = sorted(k for k in set(old.settings) | set(new.settings) if old.settings.get(k) != new.settings.get(k))
    if diff:
        k = diff[0]
        return f"the data setting {k} changed ({old.settings.get(k)!r} at save, {new.settings.get(k)!r} now)"
    return f"the data's content key changed ({old.key[:12]} at save, {new.key[:12]} now)"
