//! Debounce in the model: each record's wait marker (its ETag), the waiter's message, and a
//! delivery's debounce step driven through the protocol core's [`Waiting`] before the coalescing
//! protocol, as the runner does (`runner/debounce.rs`); the consumer's handling of its end
//! (persist the waiter in place, acknowledge, retry).
//!
//! Time is not modelled: a waiter's wake may come at any point, the quiet period Q is "the
//! waiter's next delivery", and the longest wait M is two periods. A configuration without
//! debounce has no wait marker at all: its possible stand-ins (a redelivered trigger, a sweep)
//! skip the delete that would find none (the runner sends it; its failure is one more storage
//! failure before the lock, which the configurations already try at the acquire).

use leasehold_runtime::protocol::carriers::Ended;
use leasehold_runtime::protocol::debounce::{
    self, Answer, Consumed, End, Etag, Path, Request, Step, Waited, Waiting,
};
use leasehold_runtime::protocol::{Machine, Step as MachineStep};

use crate::consumer::comes_back;
use crate::world::{Config, Delivery, Msg, Successor, Wait, World, ok};

/// The longest wait M, in quiet periods.
const LONGEST: u8 = 2;

/// A delivery's debounce step in progress.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Debouncing {
    pub path: Path,
    pub waiting: Waiting,
    pub step: Step,
    /// The ETag its create returned, and the one its look found.
    pub created: Option<u8>,
    pub looked: Option<u8>,
}

impl Debouncing {
    /// The debounce step of a delivery of `msg`, if it has one.
    pub fn start(config: &Config, msg: &Msg) -> Option<Self> {
        let waited = msg.wait.map(|w| Waited {
            owed: w.owed,
            longest: w.waited >= LONGEST,
        });
        let path = debounce::path(msg.kind.trigger_kind(), waited, msg.dequeued > 1, config.debounce);
        if path == Path::Skip || !config.debounce {
            return None;
        }
        let (waiting, step) = Waiting::start(path, config.fault);
        Some(Self {
            path,
            waiting,
            step,
            created: None,
            looked: None,
        })
    }
}

impl World {
    pub(crate) fn debounce_successors(
        &self,
        config: &Config,
        w: usize,
        debouncing: Debouncing,
        actor: &str,
        out: &mut Vec<Successor>,
    ) {
        match debouncing.step {
            Step::Send(request) => self.wait_request(w, request, actor, out),
            Step::Done(end) => self.debounced(config, w, end, actor, out),
        }
    }

    /// Every way storage may answer a wait-marker request of worker `w`.
    fn wait_request(&self, w: usize, request: Request, actor: &str, out: &mut Vec<Successor>) {
        let r = self.record_of(w);
        let marker = self.records[r].wait;
        let faulty = self.faults > 0;
        // (the world after, the answer, what)
        let mut ways: Vec<(World, Answer, String)> = Vec::new();
        match request {
            Request::Create => match marker {
                None => {
                    let mut created = self.clone();
                    created.records[r].etags += 1;
                    let etag = created.records[r].etags;
                    created.records[r].wait = Some(etag);
                    let mut learnt = created.clone();
                    learnt.debouncing(w).created = Some(etag);
                    ways.push((
                        learnt,
                        Answer::Created,
                        format!("create wait marker: created, etag {etag}"),
                    ));
                    if faulty {
                        ways.push((
                            created.with_fault_spent(),
                            Answer::Exists { retried: true },
                            "create wait marker: landed, answer lost; the retry: there already".into(),
                        ));
                        ways.push((
                            created.with_fault_spent(),
                            Answer::Failed,
                            "create wait marker: landed, then every retry fails".into(),
                        ));
                        ways.push((
                            self.with_fault_spent(),
                            Answer::Failed,
                            "create wait marker: fails".into(),
                        ));
                    }
                }
                Some(_) => {
                    ways.push((
                        self.clone(),
                        Answer::Exists { retried: false },
                        "create wait marker: there already".into(),
                    ));
                    if faulty {
                        ways.push((
                            self.with_fault_spent(),
                            Answer::Failed,
                            "create wait marker: fails".into(),
                        ));
                    }
                }
            },
            Request::Touch => {
                let mut touched = self.clone();
                if marker.is_some() {
                    touched.records[r].etags += 1;
                    touched.records[r].wait = Some(touched.records[r].etags);
                }
                let found = marker.is_some();
                ways.push((
                    touched.clone(),
                    Answer::Touched { found },
                    format!("touch wait marker: found {found}"),
                ));
                if faulty {
                    ways.push((
                        touched.with_fault_spent(),
                        Answer::Failed,
                        "touch wait marker: landed, answer lost".into(),
                    ));
                    ways.push((
                        self.with_fault_spent(),
                        Answer::Failed,
                        "touch wait marker: fails".into(),
                    ));
                }
            }
            Request::Look => {
                let seen = self.workers[w]
                    .delivery
                    .as_ref()
                    .unwrap()
                    .msg
                    .wait
                    .and_then(|x| x.etag);
                let mut looked = self.clone();
                looked.debouncing(w).looked = marker;
                ways.push((
                    looked,
                    Answer::Looked(marker.map(|e| Some(e) == seen)),
                    format!("look at wait marker: etag {marker:?} (the waiter saw {seen:?})"),
                ));
                if faulty {
                    ways.push((
                        self.with_fault_spent(),
                        Answer::Failed,
                        "look at wait marker: fails".into(),
                    ));
                }
            }
            Request::Consume { if_unchanged } => {
                let condition = if if_unchanged {
                    self.workers[w]
                        .delivery
                        .as_ref()
                        .unwrap()
                        .debouncing
                        .as_ref()
                        .unwrap()
                        .looked
                } else {
                    None
                };
                let what = match marker {
                    None => Consumed::Gone,
                    Some(e) if condition.is_some_and(|c| c != e) => Consumed::Changed,
                    Some(_) => Consumed::Consumed,
                };
                let mut after = self.clone();
                if what == Consumed::Consumed {
                    after.records[r].wait = None;
                }
                let name = "consume wait marker";
                ways.push((
                    after.clone(),
                    Answer::Consumed { what, retried: false },
                    format!("{name}: {what:?}"),
                ));
                if faulty {
                    let retried = Answer::Consumed { what, retried: true };
                    ways.push((
                        after.with_fault_spent(),
                        retried,
                        format!("{name}: first attempt failed; the retry: {what:?}"),
                    ));
                    if what == Consumed::Consumed {
                        let gone = Answer::Consumed {
                            what: Consumed::Gone,
                            retried: true,
                        };
                        ways.push((
                            after.with_fault_spent(),
                            gone,
                            format!("{name}: consumed, answer lost; the retry: gone"),
                        ));
                    }
                    ways.push((
                        after.with_fault_spent(),
                        Answer::Failed,
                        format!("{name}: landed, then every retry fails"),
                    ));
                    ways.push((self.with_fault_spent(), Answer::Failed, format!("{name}: fails")));
                }
            }
        }
        for (mut world, answer, what) in ways {
            let d = world.debouncing(w);
            d.step = d.waiting.on(answer);
            out.push(ok(world, actor, what));
        }
    }

    /// Under Functions, the handler's end of a delivery whose debounce step ended it: the
    /// watchdog becomes the waiter, or is deleted, or becomes the retry. `self` is the world with
    /// the delivery taken out.
    fn debounced_watched(
        self,
        config: &Config,
        d: &Delivery,
        debouncing: &Debouncing,
        end: End,
        actor: &str,
        out: &mut Vec<Successor>,
    ) {
        let msg = &d.msg;
        // Its retry is its message, marked as the carrier of a delivery that may leave a wait
        // marker, with no `afterToken`.
        let marks = debouncing.path.marks_carrier();
        let retry = Msg {
            after_token: None,
            wait: if marks {
                msg.wait.or(Some(Wait::default()))
            } else {
                msg.wait
            },
            ..msg.clone()
        };
        let (ended, follow, reached) = match end {
            End::Wait { etag, owed } => {
                // A new message: the watchdog, rewritten (no attempt of its own).
                let waiter = Msg {
                    dequeued: 0,
                    wait: Some(waited(msg, debouncing, etag, owed)),
                    ..msg.clone()
                };
                let reached = matches!(debouncing.path, Path::Wake { .. }).then_some(15);
                (Ended::FollowUp, Some(waiter), reached)
            }
            End::Joined => (Ended::Acknowledged, None, Some(14)),
            End::NotOwed => (Ended::Acknowledged, None, None),
            End::StorageFailed { .. } => (Ended::Failed { gives_up: false }, None, None),
            End::Carry { .. } => unreachable!("carried on into the protocol"),
        };
        let what = format!("ends {end:?}");
        self.watched_end(config, d, ended, follow, retry, what, reached, actor, out);
    }

    fn debouncing(&mut self, w: usize) -> &mut Debouncing {
        self.workers[w]
            .delivery
            .as_mut()
            .unwrap()
            .debouncing
            .as_mut()
            .unwrap()
    }

    /// The consumer's handling of a debounce step's end (standalone, as `Consumer` does), or on
    /// into the coalescing protocol.
    fn debounced(&self, config: &Config, w: usize, end: End, actor: &str, out: &mut Vec<Successor>) {
        let mut next = self.clone();
        let mut d = next.workers[w].delivery.take().unwrap();
        let debouncing = d.debouncing.take().unwrap();
        let msg = d.msg.clone();
        if config.functions && !matches!(end, End::Carry { .. }) {
            return next.debounced_watched(config, &d, &debouncing, end, actor, out);
        }
        let (acknowledge, reached) = match end {
            End::Carry { owes } => {
                // On as the message without its wait; one that consumed a marker owes a run that
                // starts after (no `afterToken`, a chain never given up).
                let mut carried = Msg {
                    wait: None,
                    ..msg.clone()
                };
                if owes {
                    carried.after_token = None;
                    carried.given_up = 0;
                }
                let (machine, step): (Machine, MachineStep) =
                    Machine::start(carried.facts(config.functions), config.fault);
                if carried != msg {
                    d.queued = Some(msg);
                }
                let what = format!("carries on as {carried} (owes a run: {owes})");
                d.msg = carried;
                d.machine = machine;
                d.step = step;
                next.workers[w].delivery = Some(d);
                let mut s = ok(next, actor, what);
                s.reached = match debouncing.path {
                    Path::Wake { .. } if owes => Some(16),
                    Path::StandIn if owes => Some(17),
                    _ => None,
                };
                out.push(s);
                return;
            }
            End::Wait { etag, owed } => {
                // The waiter: the delivered message, rewritten in place and hidden for another
                // period (not an attempt). If the update fails, it comes back as it was, and as a
                // redelivery stands in.
                let waiter = Msg {
                    prior: msg.attempts() - 1,
                    dequeued: 0,
                    wait: Some(waited(&msg, &debouncing, etag, owed)),
                    ..msg.clone()
                };
                let before = next.clone();
                let what = format!("ends {end:?}: the message becomes {waiter}");
                next.put(waiter);
                let mut s = ok(next, actor, what);
                s.reached = matches!(debouncing.path, Path::Wake { .. }).then_some(15);
                out.push(s);
                if self.faults > 0 {
                    let what = format!("ends {end:?}: the update fails, the message comes back");
                    out.push(comes_back(before, msg, actor, what));
                }
                return;
            }
            End::Joined => (true, Some(14)),
            End::NotOwed => (true, None),
            End::StorageFailed { .. } => (false, None),
        };
        if acknowledge {
            next.acknowledged(&d, format!("ends {end:?}"), reached, actor, out);
        } else {
            let retry = Msg {
                after_token: None,
                ..msg
            };
            let what = format!("ends {end:?}: {retry} comes back for a retry");
            next.put(retry);
            out.push(ok(next, actor, what));
        }
    }
}

/// The wait a waiter's next message carries.
fn waited(msg: &Msg, debouncing: &Debouncing, etag: Etag, owed: bool) -> Wait {
    let etag = match etag {
        Etag::Created => debouncing.created,
        Etag::Looked => debouncing.looked,
        Etag::Unknown => None,
    };
    let waited = msg.wait.map_or(0, |x| x.waited);
    Wait {
        etag,
        waited: (waited + 1).min(LONGEST),
        owed,
    }
}
