"""Federated instruction data: records, loaders, prompts, tokenization, partitions, generated suite.

Benchmark data is read from the folder ``FEDMOSAIC_DATA_DIR`` names (:func:`data_dir`), else from the user's
data cache ``fedmosaic data fetch`` fills (:func:`cache_data_dir`); never copied here.
"""

from training.data.benchmarks import BENCHMARKS, cache_data_dir, data_dir, data_key, identify
from training.data.generated import generate_suite, write_suite
from training.data.loaders import (
    DATA_DIR_HELP,
    load_dataset,
    load_feddpa_format,
    load_folder,
    load_run_dataset,
    read_records,
)
from training.data.partition import dirichlet, hold_out, leave_out, pool, sample_clients, split_tasks
from training.data.partitioners import PARTITION_HELP, histogram, parse_partition, read_split, write_split
from training.data.prompts import PromptConfig, format_prompt
from training.data.records import ClientData, DataError, FederatedDataset, Record, Split
from training.data.tokenize import IGNORE, Example, collate, prompt_texts, tokenize_record

__all__ = [
    "BENCHMARKS", "PARTITION_HELP", "Split", "cache_data_dir", "data_key", "histogram", "identify", "parse_partition",
    "read_split", "write_split",
    "DATA_DIR_HELP", "IGNORE", "ClientData", "DataError", "Example", "FederatedDataset", "PromptConfig", "Record",
    "collate", "data_dir", "dirichlet", "format_prompt", "generate_suite", "hold_out", "leave_out", "load_dataset",
    "load_feddpa_format", "load_folder", "load_run_dataset", "pool", "prompt_texts", "read_records", "sample_clients",
    "split_tasks", "tokenize_record", "write_suite",
]
