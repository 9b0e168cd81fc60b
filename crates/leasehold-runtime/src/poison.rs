//! Poison entries: a trigger given up (or a message that is no trigger) and why, in a form that
//! always fits the queue.

use std::borrow::Cow;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::message::{DecodeError, MAX_CORRELATION_ID_LEN, TriggerMessage, truncate_to};
use crate::queue::MAX_MESSAGE_BYTES;

/// Most of an unreadable message's body an entry keeps, in bytes (before JSON and base64).
const BODY_KEPT: usize = 32 * 1024;
/// Most of the reason an entry keeps, in bytes (a logic's error output can be long).
const REASON_KEPT: usize = 8 * 1024;

/// What the poison queue holds: the trigger, or the body of a message that is no trigger, and
/// why it was given up (the text of the [`Error`] that gave it up, for operators).
///
/// A trigger is stored once, decoded (its wire body is its [`TriggerMessage::encode`]); only a
/// message that could not be read keeps its body, cut if need be. [`encode`](Self::encode)
/// cuts the body and the reason further until the entry fits the queue's 64 KiB, so writing
/// an entry can never be refused for its size — a refused entry would keep its trigger
/// retried, and given up, for ever.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoisonMessage {
    /// The body of a message that is no trigger (entries written before this format also hold
    /// a trigger's body beside it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    body: Option<String>,
    /// The original body's length in bytes, when `body` holds only its start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    body_bytes: Option<usize>,
    /// The trigger, when the body could be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<TriggerMessage>,
    reason: String,
    pub dequeue_count: u32,
}

impl PoisonMessage {
    /// The entry for a message given up because of `error`: `body` is the message as it was on
    /// the queue, kept only when it is no trigger (`trigger` is `None`).
    pub fn new(body: String, trigger: Option<TriggerMessage>, error: &Error, dequeue_count: u32) -> Self {
        Self {
            body: trigger.is_none().then_some(body),
            body_bytes: None,
            trigger,
            reason: error.to_string(),
            dequeue_count,
        }
    }

    /// Why the message was given up.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// The message body: the one kept for a message that is no trigger (possibly only its
    /// start, see [`is_cut`](Self::is_cut)), else the trigger's wire form.
    pub fn body(&self) -> Cow<'_, str> {
        match (&self.body, &self.trigger) {
            (Some(body), _) => Cow::Borrowed(body),
            (None, Some(trigger)) => Cow::Owned(trigger.encode()),
            (None, None) => Cow::Borrowed(""),
        }
    }

    /// Whether the kept body is only the start of the original.
    pub fn is_cut(&self) -> bool {
        self.body_bytes.is_some()
    }

    /// The poison queue's wire form: base64 of the JSON, like trigger messages, so tools reading
    /// either queue decode alike. Always at most [`MAX_MESSAGE_BYTES`]: the body and the reason
    /// are cut (and say so) until it fits.
    pub fn encode(&self) -> String {
        let mut kept = (BODY_KEPT, REASON_KEPT);
        loop {
            let wire = STANDARD.encode(self.cut(kept.0, kept.1).to_json());
            // With nothing of either kept the entry is a bounded trigger and a few numbers.
            if wire.len() <= MAX_MESSAGE_BYTES || kept == (0, 0) {
                return wire;
            }
            kept = (kept.0 / 2, kept.1 / 2);
        }
    }

    /// Reads the wire form back (for operators' tools and tests).
    pub fn decode(body: &str) -> Result<Self, DecodeError> {
        let bytes = STANDARD
            .decode(body.trim())
            .map_err(|_| DecodeError::new("poison message is not base64"))?;
        serde_json::from_slice(&bytes).map_err(|e| DecodeError::new(format!("poison message: {e}")))
    }

    fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a poison message always serialises")
    }

    /// This entry with its body and reason cut to these many bytes (the trigger's correlation
    /// id too, in case it was built in code rather than read).
    fn cut(&self, body_kept: usize, reason_kept: usize) -> Self {
        let mut entry = self.clone();
        if let Some(body) = &self.body
            && body.len() > body_kept
        {
            entry.body = Some(truncate_to(body, body_kept).to_string());
            entry.body_bytes = Some(self.body_bytes.unwrap_or(body.len()));
        }
        if self.reason.len() > reason_kept {
            entry.reason = format!(
                "{} [cut from {} bytes]",
                truncate_to(&self.reason, reason_kept),
                self.reason.len()
            );
        }
        if let Some(trigger) = &mut entry.trigger
            && let Some(id) = &mut trigger.correlation_id
        {
            *id = truncate_to(id, MAX_CORRELATION_ID_LEN).to_string();
        }
        entry
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::LogicError;

    fn failed(text: &str) -> Error {
        Error::Logic(LogicError::new(text.to_string()))
    }

    /// The trigger is kept once, decoded: its body is its wire form.
    #[test]
    fn a_trigger_is_stored_once() {
        let trigger = TriggerMessage::parse("account", "42").unwrap();
        let entry = PoisonMessage::new(trigger.encode(), Some(trigger.clone()), &failed("boom"), 5);
        let json = String::from_utf8(STANDARD.decode(entry.encode()).unwrap()).unwrap();
        assert!(!json.contains("\"body\""), "{json}");
        let back = PoisonMessage::decode(&entry.encode()).unwrap();
        assert_eq!(back.trigger, Some(trigger.clone()));
        assert_eq!(back.body(), trigger.encode());
        assert!(back.reason().contains("boom"));
        assert!(!back.is_cut());
    }

    /// Whatever is given up — a body at the queue's limit that is no trigger, JSON-escaped to six
    /// times its size, a reason of a megabyte — the entry fits the queue, and says what it cut.
    #[test]
    fn an_entry_always_fits_the_queue() {
        let worst_body = "\u{1}".repeat(MAX_MESSAGE_BYTES);
        let long_reason = "\u{2}".repeat(1 << 20);
        for (body, reason) in [
            (worst_body.clone(), "short".to_string()),
            ("x".repeat(MAX_MESSAGE_BYTES), long_reason.clone()),
            (worst_body, long_reason),
        ] {
            let entry = PoisonMessage::new(body.clone(), None, &failed(&reason), 9);
            let wire = entry.encode();
            assert!(wire.len() <= MAX_MESSAGE_BYTES, "{}", wire.len());
            let back = PoisonMessage::decode(&wire).unwrap();
            assert!(back.is_cut() || back.body() == body);
            assert!(body.starts_with(&*back.body()));
            assert_eq!(back.dequeue_count, 9);
        }
        let mut trigger = TriggerMessage::parse("account", "42").unwrap();
        trigger.correlation_id = Some("c".repeat(100_000));
        let entry = PoisonMessage::new(String::new(), Some(trigger), &failed(&"r".repeat(100_000)), 5);
        let wire = entry.encode();
        assert!(wire.len() <= MAX_MESSAGE_BYTES, "{}", wire.len());
        let back = PoisonMessage::decode(&wire).unwrap();
        let full = failed(&"r".repeat(100_000)).to_string().len();
        assert!(
            back.reason().ends_with(&format!("[cut from {full} bytes]")),
            "{}",
            &back.reason()[back.reason().len() - 40..]
        );
    }

    /// What fits is kept whole: a body that is no trigger and a reason, each up to what an
    /// entry keeps at most (32 KiB, 8 KiB).
    #[test]
    fn what_fits_is_kept_whole() {
        for (body_len, reason_len) in [(30_000, 6_000), (BODY_KEPT, REASON_KEPT - "logic failed: ".len())] {
            let body = "b".repeat(body_len);
            let reason = "r".repeat(reason_len);
            let entry = PoisonMessage::new(body.clone(), None, &failed(&reason), 5);
            let back = PoisonMessage::decode(&entry.encode()).unwrap();
            assert!(!back.is_cut(), "{body_len}");
            assert_eq!(back.body(), body);
            assert!(
                back.reason().contains(&reason) && !back.reason().contains("[cut"),
                "{reason_len}"
            );
        }
    }

    /// An entry that does not fit is cut only as far as needed: a body JSON-escaped to six times
    /// its size keeps its first few KiB.
    #[test]
    fn a_cut_keeps_as_much_as_fits() {
        let body = "\u{1}".repeat(MAX_MESSAGE_BYTES);
        let entry = PoisonMessage::new(body, None, &failed("short"), 5);
        let back = PoisonMessage::decode(&entry.encode()).unwrap();
        assert!(back.is_cut());
        assert!(back.body().len() >= 2 * 1024, "{}", back.body().len());
        // The reason likewise: escaped to six times its size, it keeps its first KiBs too.
        let reason = "\u{2}".repeat(1 << 20);
        let entry = PoisonMessage::new("x".repeat(MAX_MESSAGE_BYTES), None, &failed(&reason), 5);
        let back = PoisonMessage::decode(&entry.encode()).unwrap();
        let kept = back.reason().chars().filter(|c| *c == '\u{2}').count();
        assert!(kept >= 1024, "{kept}");
    }

    /// Entries written before this format held the body beside the trigger: still read.
    #[test]
    fn reads_entries_that_hold_body_and_trigger() {
        let trigger = TriggerMessage::parse("account", "42").unwrap();
        let old = serde_json::json!({
            "body": trigger.encode(),
            "trigger": trigger,
            "reason": "gave up",
            "dequeueCount": 5,
        });
        let back = PoisonMessage::decode(&STANDARD.encode(old.to_string())).unwrap();
        assert_eq!(back.trigger, Some(trigger.clone()));
        assert_eq!(back.body(), trigger.encode());
    }
}
