//! A Parquet shard's rows as JSON objects, read row group by row group through the `parquet` crate's
//! record reader (no Arrow: rows are what the loaders take). Strings stay strings, lists (a
//! conversation's messages) arrays, structs objects.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::file::reader::FileReader;
use parquet::file::serialized_reader::SerializedFileReader;
use parquet::record::reader::RowIter;

use super::{At, Location};
use crate::data::Row;
use crate::{Result, TrainError};

/// The rows left in one Parquet file.
pub struct ParquetRows {
    file: Arc<PathBuf>,
    rows: RowIter<'static>,
    index: usize,
}

impl ParquetRows {
    /// Opens `path` (its footer is read now: a file that is not Parquet fails here, by name).
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(TrainError::io("read", path))?;
        let reader = SerializedFileReader::new(file).map_err(|e| {
            TrainError::data(path.display(), format!("not a readable Parquet file: {e}"))
        })?;
        let rows = RowIter::from_file_into(Box::new(reader) as Box<dyn FileReader>);
        Ok(Self {
            file: Arc::new(path.to_path_buf()),
            rows,
            index: 0,
        })
    }

    /// The next row, `None` after the last.
    pub fn next(&mut self) -> Option<Result<(Location, Row)>> {
        let row = self.rows.next()?;
        let at = Location {
            file: self.file.clone(),
            at: At::Row(self.index),
        };
        self.index += 1;
        Some(match row {
            Ok(row) => match row.to_json_value() {
                serde_json::Value::Object(o) => Ok((at, o)),
                _ => Err(TrainError::data(at, "a row that is not a record")),
            },
            Err(e) => Err(TrainError::data(
                at,
                format!("unreadable Parquet data: {e}"),
            )),
        })
    }
}
