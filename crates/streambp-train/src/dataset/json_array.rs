//! The elements of a JSON array file one at a time, in bounded memory: serde_json's deserializer
//! pushes each element to a visitor, which hands it through a small bounded channel to the iterator
//! the loader pulls from (a reader thread per open file). A loader that stops early drops the
//! receiver, and the thread stops at its next element.

use std::fmt;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};

use serde::de::{DeserializeSeed, Deserializer, SeqAccess, Visitor};

/// Elements read ahead of the loader: enough to keep the reader busy, few enough not to matter.
const READ_AHEAD: usize = 64;

/// The elements of a JSON array file, in order; an error ends them.
pub struct ArrayElements {
    rx: Receiver<Result<serde_json::Value, String>>,
}

impl ArrayElements {
    /// Starts reading `path` (opened by the caller, so that a missing file is reported at once).
    pub fn start(file: std::fs::File) -> Self {
        let (tx, rx) = sync_channel(READ_AHEAD);
        std::thread::spawn(move || {
            let mut reader = std::io::BufReader::new(file);
            skip_bom(&mut reader);
            let mut de = serde_json::Deserializer::from_reader(reader);
            let sent = Forward { tx: tx.clone() };
            let outcome = de.deserialize_seq(sent).and_then(|()| de.end());
            if let Err(e) = outcome {
                // Nothing to do if the loader is gone: then nobody waits for the error.
                let _ = tx.send(Err(e.to_string()));
            }
        });
        Self { rx }
    }
}

impl Iterator for ArrayElements {
    type Item = Result<serde_json::Value, String>;

    fn next(&mut self) -> Option<Self::Item> {
        self.rx.recv().ok()
    }
}

/// Steps past a UTF-8 byte-order mark at the start of `reader`, if there is one (a read error is
/// left for the parser to meet).
fn skip_bom(reader: &mut std::io::BufReader<std::fs::File>) {
    use std::io::BufRead;
    if let Ok(buf) = reader.fill_buf() {
        if buf.starts_with(&[0xef, 0xbb, 0xbf]) {
            reader.consume(3);
        }
    }
}

/// Sends each element of the array down the channel as it is parsed.
struct Forward {
    tx: SyncSender<Result<serde_json::Value, String>>,
}

impl<'de> Visitor<'de> for Forward {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON array of objects")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(value) = seq.next_element_seed(Element)? {
            if self.tx.send(Ok(value)).is_err() {
                // The loader stopped reading: stop parsing.
                return Ok(());
            }
        }
        Ok(())
    }
}

/// One element, parsed whole (a row is small; the array is not).
struct Element;

impl<'de> DeserializeSeed<'de> for Element {
    type Value = serde_json::Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        serde::Deserialize::deserialize(d)
    }
}
