//! Per-scope settings: one deployment serves several CRM tables, and each may need its own
//! value of a flow-control setting (how long a trigger may be put off, say). [`PerScope`] holds a
//! default and the scopes that override it, and reads the settings form
//! `<default>[,<scope>=<value>]…` (for example `86400,account=3600,contact=600`).

use std::fmt;
use std::str::FromStr;

use crate::record::{InvalidName, Scope};

/// A value for every scope: a default, and the scopes that override it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PerScope<T> {
    default: T,
    scopes: Vec<(Scope, T)>,
}

impl<T> PerScope<T> {
    /// `default` for every scope.
    pub fn new(default: T) -> Self {
        Self {
            default,
            scopes: Vec::new(),
        }
    }

    /// This, with `value` for `scope` (replacing an earlier one).
    pub fn with(mut self, scope: Scope, value: T) -> Self {
        self.scopes.retain(|(s, _)| *s != scope);
        self.scopes.push((scope, value));
        self
    }

    /// The value for `scope`.
    pub fn get(&self, scope: &Scope) -> &T {
        self.scopes
            .iter()
            .find(|(s, _)| s == scope)
            .map_or(&self.default, |(_, v)| v)
    }

    pub fn default_value(&self) -> &T {
        &self.default
    }

    /// Each value turned by `f`.
    pub fn map<U>(self, f: impl Fn(T) -> U) -> PerScope<U> {
        PerScope {
            default: f(self.default),
            scopes: self.scopes.into_iter().map(|(s, v)| (s, f(v))).collect(),
        }
    }

    /// The scopes with a value of their own, with it.
    pub fn overrides(&self) -> impl Iterator<Item = (&Scope, &T)> {
        self.scopes.iter().map(|(s, v)| (s, v))
    }

    /// Every value: the default's, then each override's.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        std::iter::once(&self.default).chain(self.scopes.iter().map(|(_, v)| v))
    }

    /// Reads `<default>[,<scope>=<value>]…`: at most one item without a scope (the default, else
    /// `default`), each scope named once, as a trigger names it (letters, digits, `_`, `.`
    /// and `-`, any case). `value` reads one value; its error says what is wrong with
    /// it. The error names the item.
    pub fn parse<E: fmt::Display>(
        text: &str,
        default: T,
        value: impl Fn(&str) -> Result<T, E>,
    ) -> Result<Self, PerScopeError> {
        let mut parsed = Self::new(default);
        let mut default_given = false;
        let bad_value = |item: &str, e: E| PerScopeError::Value {
            item: item.to_string(),
            why: e.to_string(),
        };
        for item in text.split(',').map(str::trim) {
            if item.is_empty() {
                return Err(PerScopeError::EmptyItem);
            }
            match item.split_once('=') {
                None => {
                    if default_given {
                        return Err(PerScopeError::SecondDefault { item: item.into() });
                    }
                    default_given = true;
                    parsed.default = value(item).map_err(|e| bad_value(item, e))?;
                }
                Some((scope, v)) => {
                    let scope = Scope::parse(scope.trim()).map_err(|error| PerScopeError::Scope {
                        item: item.into(),
                        error,
                    })?;
                    if parsed.scopes.iter().any(|(s, _)| *s == scope) {
                        return Err(PerScopeError::ScopeTwice {
                            item: item.into(),
                            scope,
                        });
                    }
                    let v = value(v.trim()).map_err(|e| bad_value(item, e))?;
                    parsed.scopes.push((scope, v));
                }
            }
        }
        Ok(parsed)
    }
}

impl<T: fmt::Display> fmt::Display for PerScope<T> {
    /// The settings form [`PerScope::parse`] reads.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.default)?;
        for (scope, value) in &self.scopes {
            write!(f, ",{scope}={value}")?;
        }
        Ok(())
    }
}

impl<T: FromStr + Default> FromStr for PerScope<T>
where
    T::Err: fmt::Display,
{
    type Err = PerScopeError;

    fn from_str(text: &str) -> Result<Self, PerScopeError> {
        Self::parse(text, T::default(), str::parse::<T>)
    }
}

/// What is wrong with a per-scope setting ([`PerScope::parse`]). Its text names the item
/// (`"account=x": not a whole number of seconds`); a setting's reader puts the setting's name in
/// front.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PerScopeError {
    /// Two commas in a row, one at an end, or no text at all.
    #[error("an empty item (two commas in a row, or one at an end)")]
    EmptyItem,
    /// A second item without a scope: the default is given once.
    #[error("\"{item}\": a second value without a scope (give the default once, then <scope>=<value> items)")]
    SecondDefault { item: String },
    /// The name before `=` is not a scope name.
    #[error("\"{item}\": not a scope name ({error})")]
    Scope { item: String, error: InvalidName },
    /// A scope named in two items.
    #[error("\"{item}\": scope {scope} is given twice")]
    ScopeTwice { item: String, scope: Scope },
    /// The value could not be read: `why` is what the value's reader said.
    #[error("\"{item}\": {why}")]
    Value { item: String, why: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(s: &str) -> Scope {
        Scope::parse(s).unwrap()
    }

    #[test]
    fn reads_a_default_and_overrides() {
        let p: PerScope<u32> = "86400, account=3600,contact=600".parse().unwrap();
        assert_eq!(*p.get(&scope("account")), 3600);
        assert_eq!(*p.get(&scope("contact")), 600);
        assert_eq!(*p.get(&scope("lead")), 86400);
        assert_eq!(p.to_string(), "86400,account=3600,contact=600");
        let only: PerScope<u32> = PerScope::parse("account=5", 7, |v| v.parse().map_err(|_| "nan")).unwrap();
        assert_eq!((*only.get(&scope("account")), *only.get(&scope("x"))), (5, 7));
    }

    #[test]
    fn names_the_item_that_is_wrong() {
        for (text, wants) in [
            ("1,2", "\"2\": a second value"),
            ("1,,account=2", "empty item"),
            ("1,account=2,account=3", "given twice"),
            ("1,a/b=2", "not a scope name"),
            ("1,account=x", "\"account=x\""),
            ("", "empty item"),
        ] {
            let e = text.parse::<PerScope<u32>>().unwrap_err().to_string();
            assert!(e.contains(wants), "{text:?}: {e}");
        }
    }

    /// Its errors are typed (issue 35: they were strings): a caller can tell what is wrong, and
    /// the text still names the item.
    #[test]
    fn its_errors_are_typed() {
        let e = |text: &str| text.parse::<PerScope<u32>>().unwrap_err();
        assert_eq!(e("1,,account=2"), PerScopeError::EmptyItem);
        assert_eq!(e(""), PerScopeError::EmptyItem);
        assert_eq!(e("1,2"), PerScopeError::SecondDefault { item: "2".into() });
        assert!(
            matches!(
                e("1,a/b=2"),
                PerScopeError::Scope { ref item, error: InvalidName::Characters { .. } } if item == "a/b=2"
            ),
            "{:?}",
            e("1,a/b=2")
        );
        assert_eq!(
            e("1,account=2,account=3"),
            PerScopeError::ScopeTwice {
                item: "account=3".into(),
                scope: scope("account")
            }
        );
        assert!(matches!(e("1,account=x"), PerScopeError::Value { ref item, .. } if item == "account=x"));
        // A value reader's own error: its text, after the item.
        let custom = PerScope::parse("account=5", 0u32, |_| Err("too big")).unwrap_err();
        assert_eq!(
            custom,
            PerScopeError::Value {
                item: "account=5".into(),
                why: "too big".into()
            }
        );
        assert_eq!(custom.to_string(), "\"account=5\": too big");
        let _: &(dyn std::error::Error + Send + Sync + 'static) = &custom;
    }
}
