//! A type-erased transactional store, so the engine and the layer have no type
//! parameters.

use std::any::Any;

use async_trait::async_trait;
use idemkit_core::{
    ClaimRequest, FencingToken, Scope, StoreError, StoreResult, StoredResponse, TransactionalStore, TxClaim,
};

/// [`TransactionalStore`] with its transaction type erased to `Box<dyn Any>`.
#[async_trait]
pub(crate) trait ErasedTxStore: Send + Sync {
    async fn claim_in_tx(&self, req: &ClaimRequest) -> StoreResult<TxClaim<Box<dyn Any + Send>>>;
    async fn complete_in_tx(
        &self,
        tx: Box<dyn Any + Send>,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()>;
    async fn rollback_tx(&self, tx: Box<dyn Any + Send>);
}

#[async_trait]
impl<S: TransactionalStore> ErasedTxStore for S {
    async fn claim_in_tx(&self, req: &ClaimRequest) -> StoreResult<TxClaim<Box<dyn Any + Send>>> {
        Ok(match TransactionalStore::claim_in_tx(self, req).await? {
            TxClaim::Claimed { tx, lease } => TxClaim::Claimed {
                tx: Box::new(tx),
                lease,
            },
            TxClaim::Other(o) => TxClaim::Other(o),
        })
    }

    async fn complete_in_tx(
        &self,
        tx: Box<dyn Any + Send>,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        let tx = tx
            .downcast::<S::Tx>()
            .map_err(|_| StoreError::Corrupt("claim transaction of the wrong type".into()))?;
        TransactionalStore::complete_in_tx(self, *tx, scope, token, response).await
    }

    async fn rollback_tx(&self, tx: Box<dyn Any + Send>) {
        // Of the wrong type it cannot be this store's: dropped, it rolls back
        // by itself.
        if let Ok(tx) = tx.downcast::<S::Tx>() {
            TransactionalStore::rollback_tx(self, *tx).await;
        }
    }
}
