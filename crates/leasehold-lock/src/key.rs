//! Lock keys: the names locks are taken on, safe to use inside blob names.

use std::fmt;

use crate::error::{Error, Result};

/// Longest key accepted (blob names allow 1024 characters; the prefixes need a few).
pub const MAX_KEY_LEN: usize = 512;

/// A validated lock key: 1–512 characters of `A–Z a–z 0–9 - _ . : @ = +` and `/` as a separator
/// between non-empty segments that are not `.` or `..`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey(String);

impl LockKey {
    pub fn new(key: impl Into<String>) -> Result<Self> {
        let key = key.into();
        let invalid = |reason| {
            Err(Error::InvalidKey {
                key: key.chars().take(80).collect(),
                reason,
            })
        };
        if key.is_empty() {
            return invalid("it is empty");
        }
        if key.len() > MAX_KEY_LEN {
            return invalid("it is longer than 512 characters");
        }
        if !key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:@=+/".contains(c))
        {
            return invalid("only A-Z a-z 0-9 - _ . : @ = + and / are allowed");
        }
        if key
            .split('/')
            .any(|seg| seg.is_empty() || seg == "." || seg == "..")
        {
            return invalid("'/' must separate non-empty segments other than '.' and '..'");
        }
        Ok(Self(key))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<&str> for LockKey {
    type Error = Error;
    fn try_from(value: &str) -> Result<Self> {
        Self::new(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_reasonable_keys() {
        for k in [
            "a",
            "account/8f9c1d2e-0000-4000-8000-000000000001",
            "scope:x/y@z=1+2",
            "A.B_C-D",
        ] {
            assert_eq!(LockKey::new(k).unwrap().as_str(), k);
        }
    }

    #[test]
    fn rejects_unsafe_keys_with_a_reason() {
        for (k, why) in [
            ("", "empty"),
            ("a//b", "non-empty segments"),
            ("/a", "non-empty segments"),
            ("a/", "non-empty segments"),
            ("a/../b", "'..'"),
            ("a b", "only"),
            ("ümlaut", "only"),
            ("a?b", "only"),
        ] {
            let e = LockKey::new(k).unwrap_err().to_string();
            assert!(e.contains(why), "{k:?}: {e}");
        }
        assert!(LockKey::new("x".repeat(513)).is_err());
    }
}
