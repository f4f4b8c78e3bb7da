//! Strict parsing of one subcommand's arguments: every flag must be one the subcommand takes,
//! every value must parse, and `--help` is answered before any device is touched.

use std::str::FromStr;

use dsv4_core::{Error, Result};

/// One subcommand's arguments: its positional words, switches and `--flag value` pairs.
#[derive(Debug, Default)]
pub struct Args {
    positional: Vec<String>,
    switches: Vec<&'static str>,
    values: Vec<(&'static str, String)>,
    /// `-h` / `--help` was given.
    pub help: bool,
}

impl Args {
    /// Parse `args` of subcommand `cmd`, which takes the flags `switches` (no value) and
    /// `valued` (one value each). An unknown flag, a missing value or a flag given twice is
    /// an error that names it.
    pub fn parse(cmd: &str, args: &[String], switches: &[&'static str], valued: &[&'static str]) -> Result<Self> {
        let mut out = Args::default();
        let mut it = args.iter();
        while let Some(a) = it.next() {
            if a == "-h" || a == "--help" {
                out.help = true;
            } else if let Some(&s) = switches.iter().find(|s| **s == a) {
                if out.switches.contains(&s) {
                    return Err(Error::Data(format!("dsv4 {cmd}: `{s}` given twice")));
                }
                out.switches.push(s);
            } else if let Some(&f) = valued.iter().find(|f| **f == a) {
                let v = it.next().filter(|v| !v.starts_with("--")).ok_or_else(|| Error::Data(format!("dsv4 {cmd}: `{f}` needs a value")))?;
                if out.values.iter().any(|(g, _)| *g == f) {
                    return Err(Error::Data(format!("dsv4 {cmd}: `{f}` given twice")));
                }
                out.values.push((f, v.clone()));
            } else if a.starts_with('-') {
                let mut known: Vec<&str> = switches.iter().chain(valued).copied().collect();
                known.sort_unstable();
                return Err(Error::Data(format!("dsv4 {cmd}: unknown option `{a}` (it takes {})", known.join(", "))));
            } else {
                out.positional.push(a.clone());
            }
        }
        Ok(out)
    }

    /// The positional words, in order.
    pub fn positional(&self) -> &[String] {
        &self.positional
    }

    /// Whether switch `name` was given.
    pub fn has(&self, name: &str) -> bool {
        self.switches.contains(&name)
    }

    /// The raw value of `name`, if given.
    pub fn raw(&self, name: &str) -> Option<&str> {
        self.values.iter().find(|(f, _)| *f == name).map(|(_, v)| v.as_str())
    }

    /// The value of `name` parsed as `T` (`what` says what it must be), if given; a value
    /// that does not parse is an error naming the flag and the value.
    pub fn value<T: FromStr>(&self, name: &str, what: &str) -> Result<Option<T>> {
        match self.raw(name) {
            None => Ok(None),
            Some(v) => v.parse().map(Some).map_err(|_| Error::Data(format!("`{name} {v}`: expected {what}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn parses_switches_values_and_words() {
        let a = Args::parse("bench", &strings(&["all", "--json", "--iters", "5"]), &["--json", "--no-sweep"], &["--iters"]).unwrap();
        assert_eq!(a.positional(), &["all".to_string()]);
        assert!(a.has("--json") && !a.has("--no-sweep") && !a.help);
        assert_eq!(a.value::<u32>("--iters", "a count").unwrap(), Some(5));
        assert_eq!(a.value::<u32>("--s", "a length").unwrap(), None);
    }

    #[test]
    fn rejects_unknown_flags_missing_and_bad_values() {
        let err = |args: &[&str]| Args::parse("check", &strings(args), &["--x"], &["--seed"]).unwrap_err().to_string();
        assert!(err(&["--sed", "1"]).contains("unknown option `--sed`"), "{}", err(&["--sed", "1"]));
        assert!(err(&["--seed"]).contains("`--seed` needs a value"));
        assert!(err(&["--seed", "--x"]).contains("`--seed` needs a value"));
        assert!(err(&["--x", "--x"]).contains("given twice"));
        let a = Args::parse("check", &strings(&["--seed", "abc"]), &[], &["--seed"]).unwrap();
        assert!(a.value::<u64>("--seed", "an integer").unwrap_err().to_string().contains("`--seed abc`: expected an integer"));
    }

    #[test]
    fn help_is_seen_anywhere() {
        assert!(Args::parse("bench", &strings(&["all", "--help"]), &[], &[]).unwrap().help);
        assert!(Args::parse("bench", &strings(&["-h"]), &[], &[]).unwrap().help);
    }
}
