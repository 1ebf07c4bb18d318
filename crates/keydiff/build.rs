//! Records the commit the library is built from (`git describe --always --dirty`), so that
//! results say which code produced them even when the binary runs from another directory.
//! Outside a git checkout (a crates.io build) nothing is recorded.

use std::path::Path;
use std::process::Command;

fn main() {
    // The directory cargo runs this script for, read when it runs: `env!` would bake in the
    // checkout the script was first compiled in, and a target dir shared by two checkouts
    // (a clean clone built into the same target) would report the other one's commit.
    let Ok(manifest) = std::env::var("CARGO_MANIFEST_DIR") else {
        return;
    };
    let root = Path::new(&manifest).join("../..");
    // Run again when HEAD moves or a source changes, so that `-dirty` stays right.
    for p in [
        ".git/HEAD",
        ".git/refs/heads",
        ".git/packed-refs",
        "crates",
        "kernels",
    ] {
        let path = root.join(p);
        if path.exists() {
            println!("cargo::rerun-if-changed={}", path.display());
        }
    }
    let out = Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .current_dir(&root)
        .output();
    if let Ok(o) = out {
        let commit = String::from_utf8_lossy(&o.stdout).trim().to_string();
        if o.status.success() && !commit.is_empty() {
            println!("cargo::rustc-env=KEYDIFF_BUILD_COMMIT={commit}");
        }
    }
}
