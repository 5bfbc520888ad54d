"""Supervised fine-tuning data: the loss on the responses (or the assistant's turns) only.

prepare-data with data.response_key stores each record as one document (the tokenizer's text start,
e.g. Llama's BOS, then prompt, response, EOD),
with data.messages_key as its conversation rendered by the chat template, and, beside the tokens,
an indexed dataset of the same documents holding 1 on the response's (the assistant's) tokens and
the EOD (`loss_mask_prefix`). `ResponseMaskedGPTDataset` is megatron's GPTDataset,
its samples packed across documents as usual, keeping the loss only where the label is one of
those tokens: a prompt is context, never a target.
"""
from __future__ import annotations

import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megadiff.data.indexed import loss_mask_prefix
from megadiff.data.prepared_dataset import PreparedGPTDataset


class ResponseMaskedGPTDataset(PreparedGPTDataset):
    def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        assert config.add_extra_token_to_sequence, "labels are the tokens shifted by one"
        self.response_tokens = IndexedDataset(loss_mask_prefix(dataset_path))

    def __getitem__(self, idx):
        item = super().__getitem__(idx)
        if idx is not None:  # megatron's padding sample has no loss anyway
            # the same documents and offsets as the tokens, read from the mask's dataset
            tokens, self.dataset = self.dataset, self.response_tokens
            try:
                mask, _ = self._query_document_sample_shuffle_indices(idx)
            finally:
                self.dataset = tokens
            # not in place: megatron may hand out one cached loss mask to every sample
            item["loss_mask"] = item["loss_mask"] * torch.from_numpy(mask[1:] == 1).to(item["loss_mask"].dtype)
        return item
