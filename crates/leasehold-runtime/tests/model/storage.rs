//! Storage in the model: every way it may answer a lock-protocol request of a delivery — the
//! lease (acquire, release) with its fencing sequence, the retrigger marker, the queue's puts —
//! within the configuration's budget of faults: fail without effect, land and lose the answer
//! (the retry then sees its own effect), fail at first and succeed on the retry, or land and
//! fail on every retry.

use leasehold_runtime::protocol::{Answer, Request};

use crate::world::{Kind, Lease, Msg, Successor, World, ok};

impl World {
    /// Every way storage may answer `request` from worker `w`.
    pub(crate) fn request(&self, w: usize, request: Request, actor: &str, out: &mut Vec<Successor>) {
        let me = w as u8;
        let r = self.record_of(w);
        // (effect, answer, a fault spent, what)
        let mut ways: Vec<(World, Answer, String)> = Vec::new();
        let faulty = self.faults > 0;
        match request {
            Request::Acquire => {
                let mut granted = self.clone();
                let lease = self.records[r].lease;
                let free = matches!(lease, Lease::Free) || lease == Lease::Held(me);
                if free {
                    granted.records[r].lease = Lease::Held(me);
                    granted.records[r].sequence += 1;
                    let token = granted.records[r].sequence;
                    granted.workers[w].delivery.as_mut().unwrap().token = Some(token);
                    ways.push((
                        granted,
                        Answer::Granted,
                        format!("acquire: granted, token {token}"),
                    ));
                    if faulty {
                        let mut landed = self.with_fault_spent();
                        landed.records[r].lease = Lease::Orphan;
                        landed.records[r].sequence += 1;
                        ways.push((
                            landed,
                            Answer::Failed,
                            "acquire: granted, but the answer is lost".into(),
                        ));
                    }
                } else {
                    ways.push((self.clone(), Answer::Held, "acquire: held".into()));
                }
                if faulty {
                    ways.push((self.with_fault_spent(), Answer::Failed, "acquire: fails".into()));
                }
            }
            Request::SetMarker | Request::TakeMarker { .. } => {
                let set = request == Request::SetMarker;
                let name = if set { "set marker" } else { "take marker" };
                let mut after = self.clone();
                let changed = after.records[r].marker != set;
                after.records[r].marker = set;
                ways.push((
                    after.clone(),
                    Answer::Marker {
                        changed,
                        retried: false,
                    },
                    format!("{name}: changed {changed}"),
                ));
                if faulty {
                    ways.push((
                        after.with_fault_spent(),
                        Answer::Marker {
                            changed: false,
                            retried: true,
                        },
                        format!("{name}: landed, answer lost; the retry: unchanged"),
                    ));
                    ways.push((
                        after.with_fault_spent(),
                        Answer::Marker {
                            changed,
                            retried: true,
                        },
                        format!("{name}: first attempt failed; the retry: changed {changed}"),
                    ));
                    ways.push((
                        after.with_fault_spent(),
                        Answer::Failed,
                        format!("{name}: landed, then every retry fails"),
                    ));
                    ways.push((self.with_fault_spent(), Answer::Failed, format!("{name}: fails")));
                }
            }
            Request::Release => {
                if self.records[r].lease == Lease::Held(me) {
                    let mut after = self.clone();
                    after.records[r].lease = Lease::Free;
                    ways.push((after.clone(), Answer::Done, "release".into()));
                    if faulty {
                        ways.push((
                            after.with_fault_spent(),
                            Answer::Failed,
                            "release: landed, answer lost".into(),
                        ));
                        ways.push((self.with_fault_spent(), Answer::Failed, "release: fails".into()));
                    }
                } else {
                    ways.push((
                        self.clone(),
                        Answer::Failed,
                        "release: the lease is not ours".into(),
                    ));
                }
            }
            Request::PutRetrigger | Request::PutLookAgain => {
                let d = self.workers[w].delivery.as_ref().unwrap();
                let m = if request == Request::PutRetrigger {
                    Msg::new(d.msg.record, Kind::Retrigger, 0, 0)
                } else {
                    d.look_again()
                };
                let mut after = self.clone();
                after.put(m.clone());
                ways.push((after.clone(), Answer::Done, format!("put {m}")));
                if faulty {
                    ways.push((
                        after.with_fault_spent(),
                        Answer::Failed,
                        format!("put {m}: landed, answer lost"),
                    ));
                    ways.push((self.with_fault_spent(), Answer::Failed, format!("put {m}: fails")));
                }
            }
        }
        for (mut world, answer, what) in ways {
            let d = world.workers[w].delivery.as_mut().unwrap();
            d.step = d.machine.on(answer);
            out.push(ok(world, actor, what));
        }
    }
}
