//! `tenure leases`: list and release leases, and run a command while holding one.

use clap::Subcommand;
use serde_json::json;
use tenure::Pool;

use crate::output::{Out, age, table};
use crate::{Failure, Outcome, lease_run};

#[derive(Subcommand)]
pub enum LeasesCommand {
    /// Every lease: holder, fence, expiry.
    List,
    /// Release a lease whoever holds it. Its holder is not told: use only for a holder you
    /// know is gone.
    Release {
        name: String,
        /// Confirm that the holder is gone.
        #[arg(long)]
        force: bool,
    },
    /// Run a command while holding the lease NAME, so runs of it never overlap (cron jobs):
    /// `tenure lease run NAME [--ttl 30s] [--wait 10m | --no-wait] -- COMMAND [ARGS...]`.
    #[command(after_help = lease_run::ABOUT)]
    Run(lease_run::RunArgs),
}

pub fn run(pool: &Pool, command: LeasesCommand, out: &Out) -> Outcome {
    let mut conn = pool.get()?;
    match command {
        LeasesCommand::List => {
            let leases = tenure::lease::list(&mut conn)?;
            out.print(
                json!(leases.iter().map(|l| json!({"name": l.name, "holder": l.holder, "fence": l.fence, "held": l.held,
                    "acquired_at": l.acquired_at, "expires_at": l.expires_at})).collect::<Vec<_>>()),
                || {
                    table(
                        &["name", "holder", "fence", "held", "expires in"],
                        leases.iter().map(|l| {
                            vec![
                                l.name.clone(),
                                l.holder.clone(),
                                l.fence.to_string(),
                                if l.held { "yes".into() } else { "no".into() },
                                if l.held { age(l.expires_at - l.now) } else { String::new() },
                            ]
                        }),
                    )
                },
            )
        }
        LeasesCommand::Release { name, force } => {
            if !force {
                return Err(Failure::new(
                    2,
                    "releasing a lease someone may hold needs --force (its holder is not told)",
                ));
            }
            let released = tenure::lease::force_release(&mut conn, &name)?;
            if !released {
                return Err(Failure::new(1, format!("no lease {name:?} is held")));
            }
            out.print(json!({"released": name}), || format!("released {name:?}"))
        }
        // Dispatched in `main`, before a pool of this size is opened.
        LeasesCommand::Run(_) => Err(Failure::new(1, "`lease run` reached the wrong place")),
    }
}
