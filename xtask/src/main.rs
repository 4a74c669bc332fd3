//! `cargo xtask`: project chores.
//!
//! `cargo xtask man DIR` writes the man pages of `ublkd` and `ublkctl` (and one per
//! `ublkctl` subcommand) into DIR, generated from the same clap definitions the
//! binaries parse (`ublkd_supervisor::cli`), so the pages cannot drift from `--help`.
//! `packaging/build-deb` calls it; the pages are in section 8 (system administration).
//!
//! `cargo xtask completions DIR` writes `ublkctl`'s and `ublkd`'s completions for bash,
//! zsh and fish into `DIR/{bash,zsh,fish}/`, named as each shell's completion
//! directory expects them, from the same definitions.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::CommandFactory;
use ublkd_supervisor::cli::{UblkctlCli, UblkdCli};

/// The man section of both programs.
const SECTION: &str = "8";

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["man", dir] => {
            let dir = PathBuf::from(dir);
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            for page in man_pages(&dir)? {
                println!("{}", page.display());
            }
            Ok(())
        }
        ["completions", dir] => {
            for file in completions(Path::new(dir))? {
                println!("{}", file.display());
            }
            Ok(())
        }
        _ => bail!("usage: cargo xtask man DIR | cargo xtask completions DIR"),
    }
}

/// Writes every page into `dir`; returns their paths.
fn man_pages(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for cmd in [UblkdCli::command(), UblkctlCli::command()] {
        let mut cmd = cmd.disable_help_subcommand(true);
        cmd.build();
        write_tree(cmd, dir, &mut written)?;
    }
    Ok(written)
}

/// Each program's completion script for each shell, in `dir/<shell>/` under the name
/// that shell's completion directory wants (bash: the program's name, zsh: `_name`,
/// fish: `name.fish`); returns their paths.
fn completions(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    use clap_complete::Shell;
    let mut written = Vec::new();
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        let shell_dir = dir.join(shell.to_string());
        std::fs::create_dir_all(&shell_dir)
            .with_context(|| format!("creating {}", shell_dir.display()))?;
        for (name, mut cmd) in [("ublkd", UblkdCli::command()), ("ublkctl", UblkctlCli::command())]
        {
            let file = match shell {
                Shell::Zsh => format!("_{name}"),
                Shell::Fish => format!("{name}.fish"),
                _ => name.to_string(),
            };
            let path = shell_dir.join(file);
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cmd, name, &mut script);
            std::fs::write(&path, script).with_context(|| format!("writing {}", path.display()))?;
            written.push(path);
        }
    }
    Ok(written)
}

/// The page of `cmd` and of each of its subcommands (`ublkctl-add.8`, …).
fn write_tree(cmd: clap::Command, dir: &Path, written: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()).cloned() {
        write_tree(sub, dir, written)?;
    }
    let version = cmd.get_version().unwrap_or(env!("CARGO_PKG_VERSION")).to_string();
    let man = clap_mangen::Man::new(cmd)
        .section(SECTION)
        .source(format!("ublkd {version}"))
        .manual("ublkd");
    let path = dir.join(man.get_filename());
    let mut page = Vec::new();
    man.render(&mut page)?;
    std::fs::File::create(&path)
        .and_then(|mut f| f.write_all(&page))
        .with_context(|| format!("writing {}", path.display()))?;
    written.push(path);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_program_and_subcommand_gets_a_section_8_page() {
        let dir = std::env::temp_dir().join(format!("ublkd-xtask-man-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pages = man_pages(&dir).unwrap();
        let names: Vec<String> =
            pages.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        for want in
            ["ublkd.8", "ublkctl.8", "ublkctl-add.8", "ublkctl-recover.8", "ublkctl-resize.8"]
        {
            assert!(names.iter().any(|n| n == want), "{want} missing from {names:?}");
        }
        let ublkd = std::fs::read_to_string(dir.join("ublkd.8")).unwrap();
        assert!(ublkd.starts_with(".ie"), "not roff: {}", &ublkd[..40.min(ublkd.len())]);
        assert!(ublkd.contains(".TH ublkd 8"), "{ublkd}");
        assert!(ublkd.contains("check\\-kernel"), "the options are missing");
        assert!(ublkd.contains("Exit status"), "the exit codes are missing");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn each_shell_gets_both_programs_completions_under_its_own_names() {
        let dir = std::env::temp_dir().join(format!("ublkd-xtask-compl-{}", std::process::id()));
        let files = completions(&dir).unwrap();
        assert_eq!(files.len(), 6, "{files:?}");
        let bash = std::fs::read_to_string(dir.join("bash/ublkctl")).unwrap();
        assert!(bash.contains("complete -F _ublkctl"), "{bash}");
        for sub in ["add", "del", "recover", "upgrade", "resize", "shutdown"] {
            assert!(bash.contains(sub), "bash completion lacks {sub}");
        }
        assert!(dir.join("zsh/_ublkctl").is_file() && dir.join("fish/ublkd.fish").is_file());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
