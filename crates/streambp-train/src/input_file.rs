//! A user's input files (a `--config` file, a `grad` batch file) read only when they are regular
//! files of bounded size: a device such as `/dev/zero`, a named pipe with no writer or a
//! directory is refused by what it is before a byte is read, and an oversized file before it fills
//! the memory.

use std::fs::FileType;
use std::io::Read;
use std::path::Path;

/// Why `path` cannot be read as an input file of at most `limit` bytes, or `None` where it can.
pub fn check(path: &Path, limit: u64) -> Option<String> {
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Some("no such file".into()),
        Err(e) => return Some(format!("cannot read: {e}")),
    };
    let kind = meta.file_type();
    if !kind.is_file() {
        return Some(format!("{}, not a regular file", what_it_is(&kind)));
    }
    (meta.len() > limit).then(|| too_large(meta.len(), limit))
}

/// The text of `path`, a regular UTF-8 file of at most `limit` bytes ([`check`]); else why not.
pub fn read_text(path: &Path, limit: u64) -> Result<String, String> {
    if let Some(why) = check(path, limit) {
        return Err(why);
    }
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read: {e}"))?;
    let mut text = String::new();
    // A file that grew since it was checked is still read no further than the limit.
    file.take(limit + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read: {e}"))?;
    match text.len() as u64 > limit {
        true => Err(too_large(text.len() as u64, limit)),
        false => Ok(text),
    }
}

fn too_large(len: u64, limit: u64) -> String {
    format!("{len} bytes, more than the {limit} such a file may hold")
}

/// What a path that is not a regular file is.
fn what_it_is(kind: &FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a named pipe"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "a special file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regular files within the limit are read; a directory, a device, a missing file and a file
    /// over the limit are refused by what they are.
    #[test]
    fn only_regular_files_within_the_limit_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a.toml");
        std::fs::write(&file, "lr = 1e-5\n").unwrap();
        assert_eq!(read_text(&file, 100).unwrap(), "lr = 1e-5\n");
        let refused = |path: &Path, limit: u64| read_text(path, limit).unwrap_err();
        assert!(refused(&file, 4).contains("10 bytes, more than the 4"));
        assert!(refused(dir.path(), 100).contains("a directory"));
        assert!(refused(Path::new("/dev/zero"), 100).contains("a character device"));
        assert_eq!(refused(&dir.path().join("missing"), 100), "no such file");
        // A named pipe with no writer: refused without opening it (which would block).
        let pipe = dir.path().join("pipe");
        let made = std::process::Command::new("mkfifo").arg(&pipe).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo");
        assert!(refused(&pipe, 100).contains("a named pipe"));
    }
}
