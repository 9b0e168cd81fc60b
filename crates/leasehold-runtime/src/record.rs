//! The names of a record: its [`Scope`] (what kind of record) and its [`RecordId`]. Each is
//! checked and put in its one canonical form once, where a trigger enters (Start, `leasehold
//! enqueue`, a queue message being read), and carried typed from there to the lock key, so every
//! path agrees on which texts name one record.

use std::fmt;
use std::str::FromStr;

use leasehold_lock::LockKey;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Longest scope: Dataverse logical names are at most 50 characters.
pub const MAX_SCOPE_LEN: usize = 64;
/// Longest record id that is not a GUID.
pub const MAX_RECORD_ID_LEN: usize = 128;

/// What kind of record (a Dataverse table's logical name, say): 1–64 characters of letters,
/// digits, `_ . -`, not starting with `.`, lower-cased (Dataverse logical names are lower case,
/// so `Account` and `account` are one scope). The default scope is `default`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Scope(String);

impl Scope {
    /// Checks `text` (surrounding white space ignored) and lower-cases it.
    pub fn parse(text: &str) -> Result<Self, InvalidName> {
        let scope = text.trim();
        if scope.is_empty() {
            return Err(InvalidName::Empty(Field::Scope));
        }
        if scope.len() > MAX_SCOPE_LEN {
            return Err(InvalidName::TooLong {
                field: Field::Scope,
                max: MAX_SCOPE_LEN,
            });
        }
        if !scope
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
            || scope.starts_with('.')
        {
            return Err(InvalidName::Characters {
                field: Field::Scope,
                value: scope.to_string(),
                allowed: "letters, digits, '_', '.' and '-'",
            });
        }
        Ok(Self(scope.to_ascii_lowercase()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for Scope {
    /// `default`: the scope of a plain `{"recordId": ...}` body that names none.
    fn default() -> Self {
        Self("default".into())
    }
}

/// A record's id: a GUID in any case, with or without braces, becomes the lower-case hyphenated
/// GUID (one record, one key), and must not be the empty GUID; any other id is 1–128 characters
/// of letters, digits and `_ . : @ = + -`, not starting with `.`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RecordId(String);

impl RecordId {
    /// Checks `text` (surrounding white space ignored) and puts a GUID in its canonical form.
    pub fn parse(text: &str) -> Result<Self, InvalidName> {
        let id = text.trim();
        if id.is_empty() {
            return Err(InvalidName::Empty(Field::RecordId));
        }
        let unbraced = id
            .strip_prefix('{')
            .and_then(|s| s.strip_suffix('}'))
            .unwrap_or(id);
        if let Ok(guid) = Uuid::try_parse(unbraced) {
            return Self::from_guid(guid);
        }
        if id.len() > MAX_RECORD_ID_LEN {
            return Err(InvalidName::TooLong {
                field: Field::RecordId,
                max: MAX_RECORD_ID_LEN,
            });
        }
        if !id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.:@=+-".contains(c))
            || id.starts_with('.')
        {
            return Err(InvalidName::Characters {
                field: Field::RecordId,
                value: id.to_string(),
                allowed: "letters, digits and _ . : @ = + -",
            });
        }
        Ok(Self(id.to_string()))
    }

    /// The id of a record named by a GUID; the empty GUID names none.
    pub fn from_guid(guid: Uuid) -> Result<Self, InvalidName> {
        if guid.is_nil() {
            return Err(InvalidName::EmptyGuid);
        }
        Ok(Self(guid.hyphenated().to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The lock key of a record: `<scope>/<record id>`. Every scope and record id make one (their
/// characters and lengths are a key segment's), so this cannot fail.
pub fn record_key(scope: &Scope, record_id: &RecordId) -> LockKey {
    LockKey::new(format!("{scope}/{record_id}")).expect("a scope and a record id always make a lock key")
}

/// Which name was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Scope,
    RecordId,
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // As the JSON bodies and queue messages spell them.
        f.write_str(match self {
            Field::Scope => "scope",
            Field::RecordId => "recordId",
        })
    }
}

/// A scope or record id that cannot name a record, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidName {
    #[error("{0} is empty")]
    Empty(Field),
    #[error("{field} is longer than {max} characters")]
    TooLong { field: Field, max: usize },
    #[error("{field} {value:?} may only hold {allowed}")]
    Characters {
        field: Field,
        value: String,
        allowed: &'static str,
    },
    #[error("recordId is the empty GUID")]
    EmptyGuid,
}

impl InvalidName {
    /// Which name was refused.
    pub fn field(&self) -> Field {
        match self {
            InvalidName::Empty(field)
            | InvalidName::TooLong { field, .. }
            | InvalidName::Characters { field, .. } => *field,
            InvalidName::EmptyGuid => Field::RecordId,
        }
    }
}

macro_rules! text_type {
    ($name:ident) => {
        impl FromStr for $name {
            type Err = InvalidName;
            fn from_str(text: &str) -> Result<Self, InvalidName> {
                Self::parse(text)
            }
        }

        impl TryFrom<String> for $name {
            type Error = InvalidName;
            fn try_from(text: String) -> Result<Self, InvalidName> {
                Self::parse(&text)
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

text_type!(Scope);
text_type!(RecordId);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_are_lower_cased_and_checked() {
        assert_eq!(Scope::parse(" Account ").unwrap().as_str(), "account");
        assert_eq!(Scope::default().as_str(), "default");
        for (bad, why) in [
            ("", "scope is empty"),
            ("   ", "scope is empty"),
            (&"a".repeat(65), "longer than 64"),
            ("a/b", "may only hold"),
            (".hidden", "may only hold"),
            ("ümlaut", "may only hold"),
        ] {
            let e = Scope::parse(bad).unwrap_err();
            assert!(e.to_string().contains(why), "{bad:?}: {e}");
            assert_eq!(e.field(), Field::Scope);
        }
        assert!(Scope::parse(&"a".repeat(64)).is_ok());
    }

    #[test]
    fn guids_take_one_form_and_other_ids_are_checked() {
        let canonical = "8f9c1d2e-0000-4000-8000-000000000001";
        for form in [
            canonical,
            "8F9C1D2E-0000-4000-8000-000000000001",
            "{8f9c1d2e-0000-4000-8000-000000000001}",
            "8f9c1d2e000040008000000000000001",
        ] {
            assert_eq!(RecordId::parse(form).unwrap().as_str(), canonical, "{form}");
        }
        assert_eq!(
            RecordId::parse("order:42@eu=1+x").unwrap().as_str(),
            "order:42@eu=1+x"
        );
        for (bad, why) in [
            ("", "recordId is empty"),
            ("00000000-0000-0000-0000-000000000000", "empty GUID"),
            (&"x".repeat(129), "longer than 128"),
            ("a/b", "may only hold"),
            ("..", "may only hold"),
            ("a b", "may only hold"),
        ] {
            let e = RecordId::parse(bad).unwrap_err();
            assert!(e.to_string().contains(why), "{bad:?}: {e}");
            assert_eq!(e.field(), Field::RecordId);
        }
    }

    /// The longest names, and every character either allows, still make a lock key.
    #[test]
    fn every_scope_and_record_id_make_a_key() {
        let scope = Scope::parse(&format!("a_.-{}", "z".repeat(MAX_SCOPE_LEN - 4))).unwrap();
        let id = RecordId::parse(&format!("a_.:@=+-{}", "9".repeat(MAX_RECORD_ID_LEN - 8))).unwrap();
        assert_eq!(record_key(&scope, &id).as_str(), format!("{scope}/{id}"));
    }

    #[test]
    fn serde_reads_through_parse() {
        let scope: Scope = serde_json::from_str("\"Contact\"").unwrap();
        assert_eq!(scope.as_str(), "contact");
        assert!(serde_json::from_str::<RecordId>("\"a/b\"").is_err());
        assert_eq!(serde_json::to_string(&scope).unwrap(), "\"contact\"");
    }
}
