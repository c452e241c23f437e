//! A Parquet shard's rows as JSON objects, read row group by row group through the `parquet` crate's
//! record reader (no Arrow: rows are what the loaders take). Strings stay strings, lists (a
//! conversation's messages) arrays, structs objects. BINARY columns holding UTF-8 are strings too (many
//! writers store text so, unannotated): `parquet`'s own JSON would give their base64, which a loader
//! would then train on as text. Bytes that are not UTF-8 (an image) are `null`: no text to read.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::file::reader::FileReader;
use parquet::file::serialized_reader::SerializedFileReader;
use parquet::record::reader::RowIter;
use parquet::record::{Field, Row as ParquetRow};
use serde_json::Value;

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
            Ok(row) => match record_json(&row) {
                Value::Object(o) => Ok((at, o)),
                _ => Err(TrainError::data(at, "a row that is not a record")),
            },
            Err(e) => Err(TrainError::data(
                at,
                format!("unreadable Parquet data: {e}"),
            )),
        })
    }
}

/// A record as a JSON object, column by column.
fn record_json(row: &ParquetRow) -> Value {
    Value::Object(
        row.get_column_iter()
            .map(|(name, field)| (name.clone(), field_json(field)))
            .collect(),
    )
}

/// `field` as JSON: `parquet`'s conversion, except for bytes (UTF-8 text as a string, else `null`),
/// inside lists, structs and maps too.
fn field_json(field: &Field) -> Value {
    match field {
        Field::Bytes(b) => match std::str::from_utf8(b.data()) {
            Ok(text) => Value::String(text.to_owned()),
            Err(_) => Value::Null,
        },
        Field::Group(row) => record_json(row),
        Field::ListInternal(list) => Value::Array(list.elements().iter().map(field_json).collect()),
        Field::MapInternal(map) => Value::Object(
            map.entries()
                .iter()
                .map(|(key, value)| {
                    let key = match field_json(key) {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    (key, field_json(value))
                })
                .collect(),
        ),
        other => other.to_json_value(),
    }
}
