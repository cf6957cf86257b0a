//! `tenure-shim`: the worker's shim launcher as a program of its own.
//!
//! Every running task has a shim, forked from its worker's launcher
//! ([`tenure_worker::launcher`]). Forked from the whole `tenure` binary, a
//! shim maps ~45 MiB of program and re-faults, page by page, the code it
//! runs; forked from this program (the launcher and the shim, nothing else),
//! it has a fraction of the page tables, page faults and resident memory
//! (see `docs/benchmarks.md`). The worker uses it when it sits beside the
//! `tenure` binary and is the same build
//! ([`tenure_worker::launcher::choose_program`]); otherwise `tenure
//! shim-launcher` does the same work.
//!
//! Its command line is fixed and internal, so it is read by hand rather
//! than with a parser that would add to every shim's size:
//! `tenure-shim shim-launcher --data-dir DIR` (the same arguments as
//! `tenure shim-launcher`, so `ps` shows a shim the same way) and
//! `tenure-shim --version`.

use std::ffi::OsString;
use std::path::Path;
use std::process::ExitCode;

#[path = "../shim_launcher.rs"]
mod shim_launcher;

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    match args.as_slice() {
        [flag] if flag == "--version" => {
            println!("{}", tenure_worker::launcher::IDENTITY);
            ExitCode::SUCCESS
        }
        [verb, flag, dir] if verb == "shim-launcher" && flag == "--data-dir" => shim_launcher::run(Path::new(dir)),
        _ => {
            eprintln!(
                "tenure-shim is started by a tenure worker, not by hand \
                 (usage: tenure-shim shim-launcher --data-dir DIR | tenure-shim --version)"
            );
            ExitCode::from(2)
        }
    }
}
