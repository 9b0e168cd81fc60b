//! Shared holds: members presenting the same share key hold one lease together.
//!
//! All members present the same lease id (derived from key and share key), which storage grants
//! to each of them. The member list lives in the lock blob's metadata, tagged with that lease id,
//! and is changed only with `If-Match` on the ETag read just before: a member that leaves last
//! writes the empty list and then releases *with `If-Match` on the ETag of that write*, so a
//! member joining in between (which changes the ETag) makes the release fail instead of freeing
//! the key under the newcomer. A member that dies simply stops renewing; when every member has
//! left or died, the lease lapses.
//!
//! Fencing: a session's founder takes the next token (one increment of the page blob's sequence
//! number, conditional on the ETag it read) and records it as the session's generation
//! (`META_SHARE_GENERATION`); a joiner inherits that token only if the blob, as read just before
//! its conditional write, shows its group's lease held, a non-empty member list and the session's
//! generation still the blob's sequence number, and only by renewing the session's lease (which
//! storage refuses once another lease came in between), never by acquiring it afresh. Every other grant increments the sequence number
//! (which also changes the ETag), so a joiner whose write goes through read the metadata its
//! group's session wrote last, and no grant came in between: the token it inherits was never
//! handed to anyone outside its session. An exclusive grant leaves the session's metadata behind,
//! but its token shows the session as over. Anything else founds a new session with a new token
//! — keeping a live session's members listed, so none is dropped.

use std::time::Duration;

use tokio::time::Instant;

use leasehold_storage::StoreErrorKind;

use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::lock::{
    LeaseGuard, LeaseLock, META_GENERATION, META_SHARE_GENERATION, META_SHARE_GROUP, META_SHARERS,
    generation_of, holder_metadata, lease_lost, lock_blob_name, release_lease,
};
use crate::store::{LeaseId, Metadata};

/// Attempts before a join or leave gives up under heavy churn.
const ATTEMPTS: usize = 16;

pub(crate) fn members(metadata: &Metadata) -> Vec<String> {
    metadata
        .get(META_SHARERS)
        .map(|list| {
            list.split(',')
                .filter(|m| !m.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// The members of the shared hold in `metadata`, if its session's token is `generation` (the
/// key's last): an exclusive grant since leaves them behind, over.
pub(crate) fn live_members(metadata: &Metadata, generation: u64) -> Vec<String> {
    if session_generation(metadata).is_some_and(|g| g == generation) {
        members(metadata)
    } else {
        Vec::new()
    }
}

fn with_members(metadata: &Metadata, group: LeaseId, list: &[String]) -> Metadata {
    let mut md = metadata.clone();
    md.insert(META_SHARERS.into(), list.join(","));
    md.insert(META_SHARE_GROUP.into(), group.to_string());
    md
}

fn belongs_to(metadata: &Metadata, group: LeaseId) -> bool {
    metadata
        .get(META_SHARE_GROUP)
        .is_some_and(|g| *g == group.to_string())
}

/// The generation the shared session in `metadata` was granted (`None`: not recorded).
fn session_generation(metadata: &Metadata) -> Option<u64> {
    metadata.get(META_SHARE_GENERATION).and_then(|g| g.parse().ok())
}

/// Whether a conditional write of a join failed because another member changed the blob (or
/// the lease went) since the read: read again.
fn is_churn(e: &leasehold_storage::StoreError) -> bool {
    matches!(
        e.kind(),
        StoreErrorKind::ConditionNotMet | StoreErrorKind::LeaseLost
    )
}

/// The pause before a join or leave reads again after churn: 10 ms, 20 ms, ...
async fn churn_pause(attempt: usize) {
    tokio::time::sleep(Duration::from_millis(10 * (attempt as u64 + 1))).await;
}

pub(crate) async fn join(lock: &LeaseLock, key: &LockKey, share_key: &str) -> Result<Option<LeaseGuard>> {
    let blob = lock_blob_name(key);
    let group = LeaseId::derived(&[key.as_str(), share_key]);
    let member = uuid::Uuid::new_v4().simple().to_string();
    let store = lock.store();
    for attempt in 0..ATTEMPTS {
        let before = match lock.retry("read shared lock", || store.properties(&blob)).await {
            Ok(p) => p,
            Err(e) if e.kind() == StoreErrorKind::NotFound => {
                lock.retry("create lock blob", || store.create_blob(&blob))
                    .await?;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        // The list is current only if our group held the lease when we read; otherwise it is
        // left over from a group whose members all died.
        let ours = before.lease_state.is_held() && belongs_to(&before.metadata, group);
        let mut list = if ours {
            members(&before.metadata)
        } else {
            Vec::new()
        };
        // The last token granted: the page blob's sequence number (a block blob from before
        // fencing moved there kept it in its metadata).
        let current = before.sequence.unwrap_or_else(|| generation_of(&before.metadata));
        // Join the session (and share its token) only if its token is the last one granted: a
        // grant since (an exclusive one leaves the session's metadata behind) moved the
        // generation on.
        let mut joining = ours && !list.is_empty() && session_generation(&before.metadata) == Some(current);
        let granted_at = Instant::now();
        if joining {
            // Only through the session's own lease: a renewal, which storage refuses once
            // another lease came in between. An acquire would also take the key afresh after
            // the session lapsed and another holder held and gave it back (its grant, cut short,
            // moving no token), and hand the lapsed session's token on.
            match lock
                .retry("renew shared lease", || store.renew_lease(&blob, group))
                .await
            {
                Ok(()) => {}
                Err(e) if e.kind() == StoreErrorKind::LeaseLost => {
                    // The session is over: found one, listing none of its members.
                    joining = false;
                    list.clear();
                    if !lock.acquire_creating(&blob, group).await? {
                        return Ok(None);
                    }
                }
                Err(e) => return Err(e.into()),
            }
        } else if !lock.acquire_creating(&blob, group).await? {
            return Ok(None);
        }
        let fencing = lock.options().fencing;
        let mut token = current;
        let mut etag = before.etag.clone();
        if !joining && fencing {
            // Founding takes the next token. A block blob is first turned into a page blob at
            // its generation, keeping the metadata as read.
            if before.sequence.is_none() {
                match lock.move_to_page_blob(&blob, group, Some(&before.etag)).await? {
                    Some(moved) => etag = moved,
                    None => continue,
                }
            }
            let increment = || store.increment_sequence(&blob, group, Some(&etag));
            match lock.retry("take fencing token", increment).await {
                Ok(Some((next, tag))) => (token, etag) = (next, tag),
                Ok(None) => continue,
                // Someone joined or left since our read: read again.
                Err(e) if is_churn(&e) => {
                    churn_pause(attempt).await;
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
        // A write of ours that landed although its answer was lost already listed us.
        if !list.contains(&member) {
            list.push(member.clone());
        }
        let mut metadata = with_members(&before.metadata, group, &list);
        if !joining {
            holder_metadata(lock.options(), &mut metadata);
            metadata.insert(META_GENERATION.into(), token.to_string());
            metadata.insert(META_SHARE_GENERATION.into(), token.to_string());
        }
        let write = || store.set_metadata(&blob, Some(group), Some(&etag), &metadata);
        match lock.retry("join shared lock", write).await {
            Ok(_) => {
                tracing::debug!(%key, %member, members = list.len(), "joined shared lock");
                return Ok(Some(LeaseGuard::start(
                    lock,
                    key.clone(),
                    blob,
                    group,
                    fencing.then_some(token),
                    granted_at,
                    Some(member),
                )));
            }
            // Someone joined or left between our read and write: read again.
            Err(e) if is_churn(&e) => churn_pause(attempt).await,
            Err(e) => return Err(e.into()),
        }
    }
    Err(Error::Contended {
        key: key.to_string(),
        attempts: ATTEMPTS,
    })
}

pub(crate) async fn leave(lock: &LeaseLock, blob: &str, group: LeaseId, member: &str) -> Result<()> {
    let store = lock.store();
    let key = LockKey::new(blob.trim_start_matches(crate::lock::LOCK_PREFIX))?;
    for attempt in 0..ATTEMPTS {
        let props = match lock.retry("read shared lock", || store.properties(blob)).await {
            Ok(p) => p,
            Err(e) if e.kind() == StoreErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        if !props.lease_state.is_held() || !belongs_to(&props.metadata, group) {
            return Ok(()); // the shared lease is gone already
        }
        let list: Vec<String> = members(&props.metadata)
            .into_iter()
            .filter(|m| m != member)
            .collect();
        let metadata = with_members(&props.metadata, group, &list);
        let write = || store.set_metadata(blob, Some(group), Some(&props.etag), &metadata);
        let etag = match lock.retry("leave shared lock", write).await {
            Ok(etag) => etag,
            Err(e) if e.kind() == StoreErrorKind::ConditionNotMet => {
                churn_pause(attempt).await;
                continue;
            }
            Err(e) if e.kind() == StoreErrorKind::LeaseLost => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        if !list.is_empty() {
            tracing::debug!(%key, member, remaining = list.len(), "left shared lock; others still hold it");
            return Ok(());
        }
        return match release_lease(lock, &key, blob, group, Some(&etag)).await {
            // A member joined after our write: the key stays held, by them.
            Err(Error::Storage(e)) if e.kind() == StoreErrorKind::ConditionNotMet => Ok(()),
            other => other,
        };
    }
    Err(lease_lost(&key))
}
