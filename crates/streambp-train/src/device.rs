//! `--device`, `--dtype` and byte-size parsing (shared with the bench, in `streambp-models`).

pub use streambp_models::device::{parse_budget, parse_bytes, parse_device, parse_dtype};
