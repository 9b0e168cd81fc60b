//! Per-scope settings: one deployment serves several CRM tables, and each may need its own
//! value of a flow-control setting (how long a trigger may be put off, say). [`PerScope`] holds a
//! default and the scopes that override it, and reads the settings form
//! `<default>[,<scope>=<value>]…` (for example `86400,account=3600,contact=600`).

use std::fmt;
use std::str::FromStr;

use crate::record::Scope;

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
    pub fn parse(text: &str, default: T, value: impl Fn(&str) -> Result<T, String>) -> Result<Self, String> {
        let mut parsed = Self::new(default);
        let mut default_given = false;
        for item in text.split(',').map(str::trim) {
            if item.is_empty() {
                return Err("an empty item (two commas in a row, or one at an end)".into());
            }
            match item.split_once('=') {
                None => {
                    if default_given {
                        return Err(format!(
                            "\"{item}\": a second value without a scope (give the default once, then <scope>=<value> items)"
                        ));
                    }
                    default_given = true;
                    parsed.default = value(item).map_err(|e| format!("\"{item}\": {e}"))?;
                }
                Some((scope, v)) => {
                    let scope = Scope::parse(scope.trim())
                        .map_err(|e| format!("\"{item}\": not a scope name ({e})"))?;
                    if parsed.scopes.iter().any(|(s, _)| *s == scope) {
                        return Err(format!("\"{item}\": scope {scope} is given twice"));
                    }
                    let v = value(v.trim()).map_err(|e| format!("\"{item}\": {e}"))?;
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
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        Self::parse(text, T::default(), |v| {
            v.parse().map_err(|e: T::Err| e.to_string())
        })
    }
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
        let only: PerScope<u32> =
            PerScope::parse("account=5", 7, |v| v.parse().map_err(|_| "nan".into())).unwrap();
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
            let e = text.parse::<PerScope<u32>>().unwrap_err();
            assert!(e.contains(wants), "{text:?}: {e}");
        }
    }
}
