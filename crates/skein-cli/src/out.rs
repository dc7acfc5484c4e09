//! Writing to stdout and stderr without panicking when the reader has gone.
//!
//! `println!` panics when stdout is a pipe whose reader closed it (`skein events ID | head
//! -1`). Every command writes through [`outln!`](crate::outln) / [`out!`](crate::out)
//! instead, which return the error; the first write that finds the pipe closed is noted, and
//! [`crate::main`] then ends the process quietly with success, as a filter in a pipeline
//! should. Diagnostics go through [`errln!`](crate::errln), which drops what cannot be
//! written: there is no one left to tell.

use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};

static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

/// Whether a write found stdout closed by its reader.
pub fn stdout_closed() -> bool {
    STDOUT_CLOSED.load(Ordering::Relaxed)
}

fn note(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::BrokenPipe {
        STDOUT_CLOSED.store(true, Ordering::Relaxed);
    }
    e
}

/// The process's stdout, locked, noting a closed pipe.
pub struct Stdout(io::StdoutLock<'static>);

/// Stdout for one write (see [`Stdout`]).
pub fn stdout() -> Stdout {
    Stdout(io::stdout().lock())
}

impl Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf).map_err(note)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush().map_err(note)
    }
}

/// Writes to stderr; what cannot be written is dropped. The line is formatted first and
/// written whole: stderr is unbuffered, and formatting straight into it makes one `write`
/// per piece of the format (each padding character among them), dozens per progress line.
pub fn err(args: std::fmt::Arguments<'_>) {
    let line = match args.as_str() {
        Some(s) => std::borrow::Cow::Borrowed(s),
        None => std::borrow::Cow::Owned(std::fmt::format(args)),
    };
    let _ = io::stderr().lock().write_all(line.as_bytes());
}

/// `println!` that returns an [`io::Result`] instead of panicking.
#[macro_export]
macro_rules! outln {
    () => {{
        use ::std::io::Write as _;
        writeln!($crate::out::stdout())
    }};
    ($($arg:tt)*) => {{
        use ::std::io::Write as _;
        writeln!($crate::out::stdout(), $($arg)*)
    }};
}

/// `print!` that returns an [`io::Result`] instead of panicking.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {{
        use ::std::io::Write as _;
        write!($crate::out::stdout(), $($arg)*)
    }};
}

/// `eprintln!` that never panics.
#[macro_export]
macro_rules! errln {
    () => {
        $crate::out::err(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::err(format_args!("{}\n", format_args!($($arg)*)))
    };
}
